"""Tokenizer round trips, streaming detokenization, and chat templates vs transformers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from edgespec.errors import EdgespecError
from edgespec.tokenizer import Tokenizer

TEXTS = [
    "def quicksort(items):\n    return sorted(items)\n",
    "naïve café — Größe: 5 µm ± 0.1 °C",
    "日本語のテキストと中文字符 🐍🚀 emoji 👩‍💻 mixed",
    "  leading spaces and\ttabs\n\n  indented",
    "ascii only",
]


@pytest.fixture(scope="module")
def demo_tok(demo_target) -> Tokenizer:
    return Tokenizer.from_dir(demo_target)


@pytest.fixture(scope="module")
def metaspace_tok(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace): its decoder strips a leading space,
    which is exactly what breaks naive token-by-token streaming."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXTS * 5 + ["hello world, the quick brown fox"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                show_progress=False))
    d = tmp_path_factory.mktemp("metaspace")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(demo_tok, text):
    ids = demo_tok.encode(text, add_special_tokens=False)
    assert demo_tok.decode(ids) == text


def test_bos_is_added_by_post_processor(demo_tok):
    ids = demo_tok.encode("x = 1")
    assert ids[0] == demo_tok.token_to_id("<|endoftext|>")
    assert ids[1:] == demo_tok.encode("x = 1", add_special_tokens=False)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    chunks = [detok.add(i) for i in ids]
    return chunks + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_is_valid_utf8_and_complete(demo_tok, text):
    ids = demo_tok.encode(text, add_special_tokens=False)
    chunks = stream(demo_tok, ids)
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)


def test_multibyte_characters_span_tokens(demo_tok):
    """The test above only means something if some character really is split."""
    ids = demo_tok.encode("🐍🚀👩‍💻", add_special_tokens=False)
    singles = [demo_tok.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in singles)
    assert "".join(stream(demo_tok, ids)) == "🐍🚀👩‍💻"


def test_a_character_cut_off_at_the_end_is_dropped_not_replaced(demo_tok):
    """Tokens that stop inside a character (an answer's token budget ends mid-emoji) do
    not end the text in U+FFFD: the stream holds whole characters up to the cut."""
    ids = demo_tok.encode("ok 🐍🚀", add_special_tokens=False)
    whole = len(demo_tok.encode("ok 🐍", add_special_tokens=False))
    cut = [n for n in range(whole + 1, len(ids)) if demo_tok.decode(ids[:n]).endswith("\ufffd")]
    assert cut  # the rocket really spans several tokens
    for n in cut:
        assert "".join(stream(demo_tok, ids[:n])) == "ok 🐍"
    assert "".join(stream(demo_tok, ids)) == "ok 🐍🚀"


def test_a_cut_off_character_is_dropped_with_byte_fallback_too(tmp_path):
    """SentencePiece's byte fallback (Gemma 3's tokenizer) spells a character it has no
    token for as byte tokens, and decodes an unfinished one to a U+FFFD per byte."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                 byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    fallback = Tokenizer.from_dir(tmp_path)
    ids = fallback.encode("a🐍", add_special_tokens=False)
    head = len(fallback.encode("a", add_special_tokens=False))
    assert len(ids) == head + 4  # the snake's four bytes
    assert fallback.decode(ids[:head + 2]).endswith("\ufffd\ufffd")
    for n in range(head + 1, len(ids)):
        assert "".join(stream(fallback, ids[:n])) == fallback.decode(ids[:head]) == "a"
    assert "".join(stream(fallback, ids)) == "a🐍"


def test_streaming_keeps_leading_spaces_with_metaspace(metaspace_tok):
    text = "hello world the quick brown fox"
    ids = metaspace_tok.encode(text)
    naive = "".join(metaspace_tok.decode([i]) for i in ids)
    assert naive != metaspace_tok.decode(ids)  # the decoder really drops spaces per token
    assert "".join(stream(metaspace_tok, ids)) == metaspace_tok.decode(ids)


def test_stream_skips_special_tokens(demo_tok):
    ids = demo_tok.encode("a = 1") + [demo_tok.token_to_id("<|im_end|>")]
    detok = demo_tok.detokenizer(skip_special_tokens=True)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "a = 1"


CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function `add`: add two numbers."}],
    [{"role": "system", "content": "You write Python."},
     {"role": "user", "content": "sort a list"},
     {"role": "assistant", "content": "sorted(xs)"},
     {"role": "user", "content": "héllo 🐍"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(demo_target, demo_tok, messages,
                                            add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_target)
    want = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    got = demo_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    want_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      add_generation_prompt=add_generation_prompt)["input_ids"]
    assert demo_tok.encode_chat(messages, add_generation_prompt) == list(want_ids)


@pytest.mark.parametrize("answer", ["def add(a, b):", "The sum is  ", "héllo 🐍", "end",
                                    ">", "im"])  # the last three recur in <|im_end|>
def test_a_final_assistant_message_is_continued_as_transformers_does(demo_target, demo_tok,
                                                                     answer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_target)
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": answer}]
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  continue_final_message=True)["input_ids"]
    assert demo_tok.encode_chat(messages, continue_final=True) == list(want)
    assert demo_tok.encode_chat(messages) != list(want)  # a closed turn and a new one
    for bad in (CONVERSATIONS[1], [*CONVERSATIONS[0], {"role": "assistant", "content": " "}]):
        with pytest.raises(EdgespecError, match="the last message must be the assistant's"):
            demo_tok.encode_chat(bad, continue_final=True)


@pytest.mark.parametrize("messages, told", [
    ([{"role": "user", "content": None}], "message 0's content must be text, not NoneType"),
    ([{"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "message 1's content must be text, not list"),
    ([{"content": "hi"}], "message 0 must be a dict with a 'role' string"),
    ([], "messages must be a non-empty list"),
    ("hi", "messages must be a non-empty list")])
def test_a_conversation_that_is_not_text_messages_is_one_sentence(demo_tok, messages, told):
    """The template would meet a None or a list of parts inside jinja: a TypeError."""
    from jinja2 import Template

    if messages and isinstance(messages, list) and "role" in messages[-1]:
        with pytest.raises(TypeError):  # what it was: the template's own failure
            Template(demo_tok.chat_template).render(messages=messages)
    with pytest.raises(EdgespecError, match=told):
        demo_tok.encode_chat(messages)


def test_chat_template_with_hf_conventions(tmp_path, demo_target):
    """A template using loop controls, tojson, trim/lstrip blocks and raise_exception,
    rendered by transformers and by us."""
    from transformers import AutoTokenizer

    template = (
        "{%- for m in messages %}\n"
        "  {%- if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
        "  {%- if loop.index > 3 %}{% break %}{% endif %}\n"
        "[{{ m.role }}] {{ m.content | tojson }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{%- if add_generation_prompt %}[assistant]{% endif %}")
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((demo_target / name).read_bytes())
    config = json.loads((demo_target / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    messages = [{"role": r, "content": f"{r} says \"hi\" ü"} for r in
                ("system", "user", "assistant", "user", "assistant")]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(EdgespecError, match="no tools here"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_bad_role_is_a_clear_error(demo_tok):
    with pytest.raises(EdgespecError, match="Roles must be"):
        demo_tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_unreadable_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(EdgespecError, match="cannot be read as a tokenizer"):
        Tokenizer.from_dir(tmp_path)
