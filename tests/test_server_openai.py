"""OpenAI features through the official `openai` client: logprobs (checked against one
independent target pass over the whole sequence) and stream_options.include_usage."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from scipy.special import log_softmax

import edgespec
from edgespec.server import create_app
from tests.http_server import running

MODEL = "edgespec-demo"
QUESTION = [{"role": "user", "content": "Write a Python function `add`: Add numbers."}]


@pytest.fixture(scope="module")
def client(engine):
    with running(create_app(engine, MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """A second engine whose target reads prompt + answer in one pass: logits for every
    position, computed apart from the decoding loops under test."""
    return edgespec.load()


def target_logprobs(reference, prompt: list[int], answer: list[int]) -> np.ndarray:
    reference.reset()
    reference.target.cache.reset()
    logits = reference.target.forward(prompt + answer[:-1])
    return log_softmax(logits[len(prompt) - 1:].astype(np.float64), axis=-1)


@pytest.mark.parametrize("mode", ["spec", "ar", "lookup"])
def test_chat_logprobs_are_the_targets(client, engine, reference, mode):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"mode": mode})
    entries = r.choices[0].logprobs.content
    prompt = engine.tokenizer.encode_chat(QUESTION)
    answer = engine.generate(prompt, max_new_tokens=20, mode="ar").token_ids
    assert len(entries) == len(answer) == r.usage.completion_tokens
    want = target_logprobs(reference, prompt, answer)
    for entry, token, row in zip(entries, answer, want, strict=True):
        assert entry.logprob == pytest.approx(row[token], abs=2e-4)
        best = np.argsort(-row, kind="stable")[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row[best], abs=2e-4)
        assert bytes(entry.bytes) == engine.tokenizer.token_bytes(token)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
    text = b"".join(bytes(e.bytes) for e in entries).decode()
    assert text == r.choices[0].message.content


def test_streamed_logprobs_match(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                           temperature=0, logprobs=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                 max_tokens=16, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    no = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert no.choices[0].logprobs is None


def test_completion_logprobs_legacy_format(client):
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-9
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_include_usage_sends_a_final_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                                temperature=0, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason
    completion = list(client.completions.create(model=MODEL, prompt="import", max_tokens=6,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert completion[-1].choices == [] and completion[-1].usage.completion_tokens >= 1


@pytest.mark.parametrize("drafter", [dict(tree_budget=8), dict(adaptive=True),
                                     dict(temperature=0.8, seed=4)])
def test_every_decoding_loop_reports_the_target_rows(engine, reference, drafter):
    """Trees, adaptive chains and sampling hand over the rows that decided each token."""
    prompt = engine.tokenizer.encode("def quicksort(items):")
    engine.reset()
    result = list(engine.records(prompt, max_new_tokens=24, logprobs=1, **drafter))
    answer = [t for r in result for t in r.tokens]
    entries = [e for r in result for e in r.logprobs]
    want = target_logprobs(reference, prompt, answer)
    assert [e.token for e in entries] == answer
    assert [e.logprob for e in entries] == pytest.approx(
        [row[t] for row, t in zip(want, answer, strict=True)], abs=2e-4)
