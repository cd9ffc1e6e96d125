"""Write edgespec/assets/draft_train/prompts.txt: the built-in prompts `edgespec
train-draft` asks the target to answer, whose answers (the target's own text) a draft head
learns from. Instructions, code and prose, from templates over topic lists; seeded, so the
file is reproducible. The benchmark prompts (edgespec/assets/bench) are kept apart from
these by a test.

    python tools/make_draft_train_prompts.py
"""

from __future__ import annotations

import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "edgespec" / "assets" / "draft_train"

CONCEPTS = [
    "photosynthesis", "compound interest", "the water cycle", "inflation", "gravity",
    "a binary search tree", "recursion", "the immune system", "supply and demand",
    "plate tectonics", "machine learning", "a neural network", "public key cryptography",
    "the greenhouse effect", "DNS", "a database index", "garbage collection", "entropy",
    "the French Revolution", "vaccines", "black holes", "a mortgage", "version control",
    "the scientific method", "electric circuits", "a budget", "jet lag", "sourdough bread",
    "the stock market", "climate and weather", "a compiler", "an API", "unit testing",
    "the Roman Empire", "volcanoes", "sleep cycles", "caching", "probability", "tides",
]
ACTIVITIES = [
    "learning a new language", "running a first marathon", "saving money", "studying for exams",
    "working from home", "cooking for a large family", "giving a presentation", "writing a CV",
    "starting a vegetable garden", "reducing screen time", "training a puppy", "moving house",
    "hiking in the mountains", "learning to play guitar", "staying focused", "meal planning",
    "debugging code", "reviewing a pull request", "planning a wedding", "camping with kids",
]
FORMS = ["poem", "short story", "haiku", "limerick", "product description", "news report",
         "diary entry", "speech", "letter", "blog post introduction"]
SUBJECTS = [
    "a lighthouse in a storm", "a robot learning to paint", "the first day of autumn",
    "a lost cat finding its way home", "a city at night", "an old bicycle", "the ocean",
    "a friendly dragon", "a time traveller", "a busy train station", "a quiet library",
    "a chess tournament", "a mountain village", "the last day of school", "a space station",
]
PAIRS = [
    ("Python", "JavaScript"), ("cats", "dogs"), ("renting", "buying a home"),
    ("SQL", "NoSQL databases"), ("trains", "planes"), ("tea", "coffee"),
    ("TCP", "UDP"), ("a laptop", "a desktop computer"), ("e-books", "paper books"),
    ("threads", "processes"), ("electric cars", "petrol cars"), ("lists", "arrays"),
]
TASKS = [
    "make a cup of tea", "change a flat tyre", "write a good commit message",
    "set up a Python virtual environment", "back up my photos", "fold a shirt",
    "prepare for a job interview", "clean a laptop keyboard", "read a nutrition label",
    "plan a weekly budget", "install a ceiling shelf", "improve my handwriting",
]
CODE_TASKS = [
    "counts the vowels in a string", "returns the n-th Fibonacci number",
    "removes duplicates from a list while keeping order", "checks whether a number is prime",
    "flattens a nested list", "merges two dictionaries", "finds the longest word in a sentence",
    "converts Celsius to Fahrenheit", "reads a CSV file and sums a column",
    "validates an email address with a regular expression", "computes the factorial of n",
    "sorts a list of tuples by their second element", "groups words by their first letter",
    "computes a moving average", "finds the most common element in a list",
    "chunks a list into pieces of size n", "transposes a matrix", "parses a date string",
    "implements a stack class", "implements a simple queue", "computes the GCD of two numbers",
    "counts word frequencies in a text", "checks whether brackets are balanced",
    "returns the binary representation of an integer", "rotates a list by k positions",
]
LANGS = ["Python", "JavaScript", "Rust", "C", "Go", "Bash"]
SNIPPETS = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s",
    "def find(items, target):\n    for i, item in enumerate(items):\n        if item == target:"
    "\n            return i\n    return -1",
    "const squares = [1, 2, 3].map(x => x * x);\nconsole.log(squares);",
    "with open('log.txt') as f:\n    errors = [line for line in f if 'ERROR' in line]",
    "def average(xs):\n    return sum(xs) / len(xs)",
    "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else i)",
    "import json\ndata = json.loads(text)\nprint(data['name'])",
    "def is_even(n):\n    return n % 2 == 1",
]
OPENINGS = [
    "The door at the end of the corridor had been locked for forty years.",
    "Mira found a map folded inside the library book.",
    "On the morning the river froze, the baker made an unusual decision.",
    "Nobody in the village had ever seen a machine like it.",
    "The message arrived at 3 a.m., written in a language no one spoke.",
    "When the lights went out across the city, Sam climbed to the roof.",
]


def prompts(rng: random.Random) -> list[str]:
    out = []
    for c in CONCEPTS:
        out += [f"Explain {c} in simple terms.", f"What is {c}? Give an example.",
                f"Write three quiz questions about {c}, with answers."]
    for a in ACTIVITIES:
        out += [f"Give me {rng.choice(['three', 'five', 'seven'])} tips for {a}.",
                f"What are common mistakes people make when {a}?"]
    for s in SUBJECTS:
        out += [f"Write a {f} about {s}." for f in rng.sample(FORMS, 3)]
    for a, b in PAIRS:
        out += [f"Compare {a} and {b}.", f"Should I choose {a} or {b}? List the pros and cons."]
    for t in TASKS:
        out += [f"How do I {t}? Explain step by step."]
    for t in CODE_TASKS:
        out += [f"Write a Python function that {t}.",
                f"Write a {rng.choice(LANGS[1:])} function that {t}, with a short explanation."]
    for s in SNIPPETS:
        out += [f"Explain what this code does:\n\n```\n{s}\n```",
                f"Review this code and suggest improvements:\n\n```\n{s}\n```"]
    for o in OPENINGS:
        out += [f"Continue this story in a few paragraphs: {o}"]
    rng.shuffle(out)
    return out


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [p.replace("\\", "\\\\").replace("\n", "\\n") for p in prompts(random.Random(0))]
    (OUT / "prompts.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(lines)} prompts -> {OUT / 'prompts.txt'}")
