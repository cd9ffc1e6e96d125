"""The engine on the demo bundle: losslessness against its own AR mode, and against
transformers' greedy generation on the fp32 export."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import edgespec
from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.runtimes import DecoderSession
from edgespec.spec.sampling import SamplingParams, warp
from edgespec.spec.tree import top_logprobs
from tests.conftest import torch_model

PROMPTS = [
    "def quicksort(items):",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(",
    "# Copyright",
    "def _parse_header(line):\n    \"\"\"Parse a header line.\"\"\"\n",
    "x",
    "try:\n    import threading\nexcept ImportError:\n",
]
CHAT = [{"role": "user", "content": "Write a Python function `flatten`: Flatten a list."}]


DRAFTERS = {
    "chain1": dict(mode="spec", draft_tokens=1),
    "chain3": dict(mode="spec", draft_tokens=3),
    "chain6": dict(mode="spec", draft_tokens=6),
    "tree8": dict(mode="spec", tree_budget=8, tree_depth=4, tree_top_k=2),
    "tree24": dict(mode="spec", tree_budget=24, tree_depth=6, tree_top_k=4),
    "specexec64": dict(mode="spec", tree_budget=64, tree_depth=10, tree_top_k=4,
                       tree_best_first=True),
    "tree+lookup": dict(mode="spec", tree_budget=12, tree_depth=4, tree_top_k=2,
                        tree_lookup=4),
    "lookup": dict(mode="lookup", draft_tokens=4),
}


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_spec_equals_greedy_ar(engine, prompt, drafter):
    ar = engine.generate(prompt, max_new_tokens=48, mode="ar")
    spec = engine.generate(prompt, max_new_tokens=48, **DRAFTERS[drafter])
    assert spec.token_ids == ar.token_ids
    assert spec.text == ar.text
    assert spec.finish_reason == ar.finish_reason
    if drafter != "lookup":
        assert spec.stats.target_passes < ar.stats.target_passes


@pytest.mark.parametrize("drafter", ["chain3", "tree24"])
def test_greedy_spec_equals_ar_through_eos(engine, drafter):
    ids = engine.tokenizer.encode_chat(CHAT)
    ar = engine.generate(ids, max_new_tokens=200, mode="ar")
    spec = engine.generate(ids, max_new_tokens=200, **DRAFTERS[drafter])
    assert spec.token_ids == ar.token_ids
    assert ar.finish_reason == spec.finish_reason


def test_ar_matches_transformers_greedy(fp32_bundle, demo_target):
    import torch

    model = torch_model(demo_target)
    engine = edgespec.load(fp32_bundle)
    for prompt in PROMPTS[:4]:
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            # BOS doubles as pad here: an explicit mask keeps generate from hiding it
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                 max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        want = out[0, len(ids):].tolist()
        got = engine.generate(prompt, max_new_tokens=32, mode="ar")
        eos = next((i for i, t in enumerate(want) if t in engine.eos_ids), len(want))
        assert got.token_ids == want[:eos]


@pytest.mark.parametrize("drafter,sampling", [
    ("chain3", dict(temperature=1.0, top_k=3)), ("tree8", dict(temperature=1.0, top_k=3)),
    ("chain3", dict(temperature=0.5))])  # plain temperature: the draft samples in-graph
def test_sampling_spec_matches_ar_distribution(engine, drafter, sampling):
    """Two-sample chi-square on the first two tokens (rare outcomes pooled out)."""
    from scipy.stats import chi2_contingency

    def outcomes(kwargs):
        counts: dict[tuple, int] = {}
        for seed in range(500):
            r = engine.generate("def main(", max_new_tokens=2, seed=seed, **sampling,
                                **kwargs)
            key = tuple(r.token_ids)
            counts[key] = counts.get(key, 0) + 1
        return counts

    ar, spec = outcomes({"mode": "ar"}), outcomes(DRAFTERS[drafter])
    keys = sorted(set(ar) | set(spec))
    table = np.array([[ar.get(k, 0) for k in keys], [spec.get(k, 0) for k in keys]])
    table = table[:, table.sum(0) >= 10]
    assert table.shape[1] >= 2
    assert chi2_contingency(table).pvalue > 1e-3


def test_ranked_draft_passes_equal_ranking_its_logits(demo_bundle):
    """The draft graph's in-graph top-k (what trees grow from) against numpy's ranking of
    the same graph's logits, over a prefill, a tree pass and a plain step in between, so
    the two bindings also share one KV cache correctly."""
    m = read_manifest(demo_bundle)
    plain, ranked = (DecoderSession(demo_bundle / m.draft.graph, m.draft,
                                    ["CPUExecutionProvider"], "cpu", 64, ranked=flag)
                     for flag in (False, True))
    prompt = [5, 80, 312, 9, 44, 7]
    for lo, hi in [(0, 4), (4, 5), (5, 6)]:  # prefill ranked, step plain, step ranked
        got = (ranked.forward_ranked(prompt[lo:hi], 4, 0.7) if hi != 5
               else (ranked.forward(prompt[lo:hi]), None))
        want = plain.forward(prompt[lo:hi])
        if got[1] is None:
            np.testing.assert_allclose(got[0], want, atol=1e-5)
            continue
        reference = top_logprobs(want, 4, 0.7)
        assert got[1].tolist() == reference[1].tolist()
        np.testing.assert_allclose(got[0], reference[0], atol=1e-4)
    past = len(prompt)
    bias = np.zeros((1, 1, 3, past + 3), np.float32)
    bias[0, 0, 1:, past] = bias[0, 0, 2, past + 1] = np.finfo(np.float32).min  # siblings
    positions = np.array([past, past, past])
    logprobs, ids = ranked.forward_ranked([11, 12, 13], 3, 1.0, positions, bias)
    reference = top_logprobs(plain.forward([11, 12, 13], positions, bias), 3)
    assert ids.tolist() == reference[1].tolist()
    np.testing.assert_allclose(logprobs, reference[0], atol=1e-4)
    assert ranked.cache.length == plain.cache.length == past + 3


def test_draft_samples_from_its_own_graph(demo_bundle):
    """forward_sample's q and CDF against warp() and cumsum of the same graph's logits."""
    m = read_manifest(demo_bundle)
    plain, ranked = (DecoderSession(demo_bundle / m.draft.graph, m.draft,
                                    ["CPUExecutionProvider"], "cpu", 64, ranked=flag)
                     for flag in (False, True))
    for ids in ([5, 80, 312, 9], [44]):
        q, cdf = ranked.forward_sample(ids, 0.7)
        want = warp(plain.forward(ids)[-1], SamplingParams(0.7))
        np.testing.assert_allclose(q, want, atol=1e-6)
        np.testing.assert_allclose(cdf, np.cumsum(q, dtype=np.float64), rtol=1e-12)
        assert cdf.dtype == np.float64
    assert ranked.cache.length == plain.cache.length == 5


def test_lookup_drafts_from_a_repetitive_prompt(engine):
    prompt = "def add(a, b):\n    return a + b\n\n\n" * 4
    r = engine.generate(prompt, max_new_tokens=40, mode="lookup")
    assert r.stats.drafted > 0 and r.stats.draft_passes == 0
    assert r.token_ids == engine.generate(prompt, max_new_tokens=40, mode="ar").token_ids


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate("def f(", max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    b = engine.generate("def f(", max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    c = engine.generate("def f(", max_new_tokens=30, temperature=0.8, top_p=0.9, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stats(engine):
    r = engine.generate(PROMPTS[0], max_new_tokens=40, mode="spec", draft_tokens=4)
    s = r.stats.to_dict()
    assert s["mode"] == "spec" and s["new_tokens"] == len(r.token_ids) == 40
    assert s["prompt_tokens"] == len(engine.tokenizer.encode(PROMPTS[0]))
    assert s["draft_passes"] == s["drafted"] >= s["accepted"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-6)
    # every decoding pass commits the accepted drafts plus one token, and none verifies
    # drafts past max_new_tokens, so no accepted token is thrown away
    assert s["new_tokens"] == 1 + s["accepted"] + (s["target_passes"] - 1)
    for settings in ({"mode": "lookup"}, {"mode": "spec", "adaptive": True},
                     {"mode": "spec", "draft_tokens": 6}):
        for n in (7, 9, 40):
            st = engine.generate(PROMPTS[1], max_new_tokens=n, **settings).stats
            assert st.new_tokens == n == st.target_passes + st.accepted, (settings, n)
    assert s["tokens_per_target_pass"] == pytest.approx(39 / (s["target_passes"] - 1), 1e-5)
    assert s["wall_s"] >= s["prefill_s"] + s["draft_s"] + s["verify_s"] - 1e-6
    assert s["device"] == "cpu"
    ar = engine.generate(PROMPTS[0], max_new_tokens=40, mode="ar").stats
    assert ar.target_passes == 40 and ar.draft_passes == 0 and ar.tokens_per_target_pass == 1


def test_stream_equals_generate(engine):
    chunks = list(engine.stream(PROMPTS[1], max_new_tokens=40))
    assert "".join(chunks) == engine.generate(PROMPTS[1], max_new_tokens=40).text
    assert all(chunks)


def test_prompt_longer_than_context(engine):
    ids = [5] * engine.context_length
    with pytest.raises(EdgespecError, match=f"{len(ids)} tokens but the model's context"):
        engine.generate(ids)


def test_generation_stops_at_context(engine):
    n = engine.context_length - 10
    for kwargs in ({"mode": "ar"}, DRAFTERS["chain6"], DRAFTERS["tree24"]):
        r = engine.generate([7] * n, max_new_tokens=100, **kwargs)
        assert len(r.token_ids) <= 10
        if r.finish_reason == "length":
            assert len(r.token_ids) == 10


def test_cancel_from_another_thread(engine):
    stream = engine.records(PROMPTS[0], max_new_tokens=400, mode="ar")
    first = next(stream)
    threading.Thread(target=engine.cancel).start()
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    assert len(first.tokens) + sum(len(r.tokens) for r in rest) < 400


@pytest.mark.parametrize("kwargs,message", [
    ({"mode": "fast"}, "unknown mode"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": "0.7"}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_k": 2.5}, "top_k must be a whole number"),
    ({"seed": 1.5}, "seed must be a whole number"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number"),
    ({"max_tokens": 4}, "unknown setting max_tokens"),
    ({"stop": ["end", ""]}, "a stop string must not be empty"),
    ({"stop": [3]}, "stop strings must be text"),
    ({"mode": "ar", "adaptive": True}, "adaptive does nothing in mode ar"),
    ({"mode": "ar", "draft_tokens": 3, "stop_rule": "entropy"},
     "draft_tokens and stop_rule do nothing in mode ar"),
    ({"mode": "lookup", "tree_budget": 8}, "tree_budget does nothing in mode lookup"),
    ({"mode": "lookup", "lookup_tokens": 2}, "lookup_tokens does nothing"),
    ({"mode": "spec", "stop_threshold": 0.6}, "stop_threshold does nothing in mode spec"),
    ({"mode": "spec", "tree_budget": 8, "draft_tokens": 2},
     "draft_tokens does nothing in mode spec with a tree"),
    ({"mode": "spec", "tree_depth": 2}, "tree_depth does nothing in mode spec;"),
    ({"max_new_tokens": None}, "max_new_tokens must be a whole number, not None"),
    ({"tree_depth": None}, "tree_depth must be a whole number"),
    ({"adaptive": "yes"}, "adaptive must be True or False"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"mode": "spec", "tree_budget": 8, "tree_lookup": "x"}, "tree_lookup must be a whole"),
    ({"mode": "spec", "tree_budget": 8, "tree_lookup": -1}, "tree_lookup must be between"),
    ({"mode": "spec", "stop_rule": "confidence", "stop_threshold": 5.0},
     r"stop_threshold must be in \(0, 1\]"),
])
def test_bad_config(engine, kwargs, message):
    with pytest.raises(EdgespecError, match=message):
        engine.generate("x", **kwargs)


def test_a_config_is_a_generation_config_and_callbacks_are_functions(engine):
    """A dict for the config, or submit's settings where its on_text callback goes (its
    parameters run prompt, on_text, on_done, config), is one sentence, not an
    AttributeError or a job that fails on its first chunk."""
    from edgespec.engine import GenerationConfig

    with pytest.raises(EdgespecError, match="config must be a GenerationConfig, not dict"):
        engine.generate("x", {"max_new_tokens": 3})
    with pytest.raises(EdgespecError, match="on_text must be a function or None, not "
                                            "GenerationConfig; pass settings as config="):
        engine.submit("x", GenerationConfig(max_new_tokens=3))
    with pytest.raises(EdgespecError, match="on_done must be a function"):
        engine.submit("x", on_done="print", max_new_tokens=3)
    assert engine.submit("x", config=GenerationConfig(max_new_tokens=3)).result(60).token_ids
    with pytest.raises(EdgespecError, match="temperature must be >= 0"):
        engine.stream("x", temperature=-1)  # at the call, as records(), not at next()


def test_load_checks_what_it_is_given():
    """A provider list is checked as --device is: a string was read a letter at a time
    (with a warning per letter), an absent provider fell back to the CPU unsaid."""
    import onnxruntime as ort

    with pytest.raises(EdgespecError, match="providers must be a non-empty list"):
        edgespec.load(providers="CPUExecutionProvider")
    absent = next(p for p in ("CUDAExecutionProvider", "DmlExecutionProvider")
                  if p not in ort.get_available_providers())
    with pytest.raises(EdgespecError, match=f"{absent} is not available in this onnxruntime"):
        edgespec.load(providers=[absent])
    with pytest.raises(EdgespecError, match="a model is a path or a Hub id"):
        edgespec.load(123)
    assert edgespec.load(providers=["CPUExecutionProvider"]).devices == "cpu"


@pytest.mark.parametrize("prompt", [None, b"def", [1.7, 2.2], [True], ""])
def test_a_prompt_is_text_or_token_ids(engine, prompt):
    with pytest.raises(EdgespecError, match="a prompt is text|the prompt is empty"):
        engine.generate(prompt, max_new_tokens=3)
    assert engine.generate(iter([5, 6, 7]), max_new_tokens=3, mode="ar").token_ids == \
        engine.generate([5, 6, 7], max_new_tokens=3, mode="ar").token_ids


def test_a_config_and_keywords_are_not_mixed_and_one_stop_string_is_one(engine):
    from edgespec.engine import GenerationConfig

    with pytest.raises(EdgespecError, match="not both"):
        engine.generate("x", GenerationConfig(max_new_tokens=20), max_new_tokens=3)
    full = engine.generate(PROMPTS[1], max_new_tokens=64, mode="ar").text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert engine.generate(PROMPTS[1], max_new_tokens=64, mode="ar", stop=stop).text == \
        full[:full.find(stop)]  # the string, not each of its characters
    assert engine.generate(PROMPTS[1], max_new_tokens=64, mode="ar", stop=None).text == full
    with pytest.raises(EdgespecError, match="threads"):
        edgespec.load(threads=-1)
    with pytest.raises(EdgespecError, match="context must be a whole number"):
        edgespec.load(context="512")
    assert edgespec.load(context=np.int64(300)).context_length == 300


def test_a_paused_stream_makes_a_second_call_on_its_thread_an_error_not_a_hang(engine):
    stream = engine.stream(PROMPTS[0], max_new_tokens=20, mode="ar")
    next(stream)
    with pytest.raises(EdgespecError, match="has a generation open"):
        engine.generate("x", max_new_tokens=3)
    stream.close()
    assert engine.generate("x", max_new_tokens=3).token_ids  # the lock was released


def test_close_cancels_the_running_job_refuses_queued_ones_and_frees_the_sessions():
    import gc
    import weakref

    engine = edgespec.load()
    target = weakref.ref(engine.target.session)
    running = engine.submit(PROMPTS[1], max_new_tokens=400, mode="ar")
    while not engine._owner:  # it has started
        pass
    queued = engine.submit(PROMPTS[0], max_new_tokens=400, mode="ar")
    waiting = engine.submit(PROMPTS[0], max_new_tokens=400, mode="ar")
    waiting.cancel()
    engine.close()
    assert running.result(timeout=60).finish_reason == "cancelled"
    for job in (queued, waiting):
        with pytest.raises(EdgespecError, match="was closed"):
            job.result(timeout=60)
    del running
    gc.collect()
    assert target() is None  # nothing holds the target's session any more


def test_close_from_another_thread_does_not_wait_for_a_paused_stream():
    """A stream left unread holds the engine: close() from another thread (an app
    shutting down) returns at once, and the sessions go when the stream ends."""
    import gc
    import weakref

    engine = edgespec.load()
    target = weakref.ref(engine.target.session)
    stream = engine.records(PROMPTS[1], max_new_tokens=400, mode="ar")
    first = next(stream)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()  # before: blocked until the stream was closed
    rest = list(stream)  # resumed, it ends cancelled after the pass it begins
    assert rest[-1].finish_reason == "cancelled"
    assert len(first.tokens) + sum(len(r.tokens) for r in rest) < 400
    del stream, first, rest
    gc.collect()
    assert target() is None
    for settings in ({}, {"mode": "spec"}):  # not "this model has no draft"
        with pytest.raises(EdgespecError, match="was closed"):
            engine.generate("x", max_new_tokens=3, **settings)
    assert engine.context_length == 512


def test_a_job_cancelled_while_queued_runs_nothing(engine):
    long = engine.submit(PROMPTS[1], max_new_tokens=400, mode="ar")
    while not engine._owner:  # it has started: the next job waits
        pass
    queued = engine.submit(PROMPTS[0], max_new_tokens=30, mode="ar")
    queued.cancel()
    long.cancel()
    result = queued.result(timeout=60)
    assert long.result(timeout=60).finish_reason == "cancelled"
    assert result.finish_reason == "cancelled" and result.token_ids == []


def test_spec_without_draft_is_a_clear_error(tmp_path, demo_target):
    from edgespec.export import export

    export(demo_target, tmp_path / "b", precision="int8")
    engine = edgespec.load(tmp_path / "b")
    assert engine.generate("x", max_new_tokens=3, mode="ar").token_ids
    with pytest.raises(EdgespecError, match="has no draft, so --mode spec cannot run"):
        engine.generate("x", mode="spec")
    # unasked, the mode is the best one the bundle has: here the target alone
    assert engine.default_mode == "ar" and edgespec.load().default_mode == "spec"
    plain = engine.generate("x", max_new_tokens=3)
    assert plain.stats.mode == "ar" and plain.token_ids == engine.generate(
        "x", max_new_tokens=3, mode="ar").token_ids


def test_unavailable_device_is_a_clear_error(demo_bundle):
    with pytest.raises(EdgespecError, match="cuda execution provider is not available"):
        edgespec.load(demo_bundle, device="cuda")


@pytest.mark.parametrize("drafter", ["chain3", "tree8", "lookup"])
def test_stop_strings(engine, drafter):
    full = engine.generate(PROMPTS[1], max_new_tokens=64, mode="ar").text
    stop = full[len(full) // 2:len(full) // 2 + 3]  # some 3 characters from the middle
    assert stop.strip(), full
    cut = full[:full.find(stop)]
    r = engine.generate(PROMPTS[1], max_new_tokens=64, stop=["never appears", stop],
                        **DRAFTERS[drafter])
    assert r.text == cut and r.finish_reason == "stop"
    chunks = list(engine.stream(PROMPTS[1], max_new_tokens=64, stop=[stop],
                                **DRAFTERS[drafter]))
    assert "".join(chunks) == cut



def test_generate_returns_the_targets_logprobs_it_was_asked_for(engine):
    """`generate(logprobs=K)` keeps what each step reported: per token, the target's
    log-softmax (checked against one target pass over the whole answer) and K others."""
    from edgespec.spec.logprobs import log_softmax

    spec = engine.generate(PROMPTS[1], max_new_tokens=24, logprobs=3)
    assert engine.generate(PROMPTS[1], max_new_tokens=24).logprobs is None
    ids = engine.encode_prompt(PROMPTS[1])
    engine.target.cache.reset()
    engine.reset()
    rows = log_softmax(engine.target.forward(ids + spec.token_ids[:-1])[len(ids) - 1:])
    assert [e.token for e in spec.logprobs] == spec.token_ids
    for row, entry in zip(rows, spec.logprobs, strict=True):
        assert entry.logprob == pytest.approx(row[entry.token], abs=1e-4)
        assert [t for t, _ in entry.top] == list(np.argsort(-row)[:3])
    out = spec.to_dict()["logprobs"]
    assert [e["token"] for e in out] == spec.token_ids and len(out[0]["top"]) == 3


@pytest.mark.parametrize("drafter", ["chain3", "lookup"])
def test_a_stop_strings_tokens_go_with_it(engine, drafter):
    """Token ids and logprobs end with the token whose text the cut text ends in: the
    tokens that only spell the stop string are not handed out."""
    full = engine.generate(PROMPTS[1], max_new_tokens=64, mode="ar")
    for at in range(8, len(full.text) - 8, 7):  # stops starting all over the answer
        stop = full.text[at:at + 4]
        cut = full.text[:full.text.find(stop)]
        records = list(engine.records(PROMPTS[1], max_new_tokens=64, stop=stop, logprobs=0,
                                      **DRAFTERS[drafter]))
        ids = [t for r in records for t in r.tokens]
        n = len(ids)
        assert "".join(r.text for r in records) == cut and ids == full.token_ids[:n], stop
        decode = engine.tokenizer.decode
        assert len(cut) <= len(decode(full.token_ids[:n]))  # no token short of the cut
        assert n == 0 or len(decode(ids[:-1])) < len(cut)  # none wholly in the stop
        assert [e.token for r in records for e in r.logprobs] == ids
        assert records[-1].stats.new_tokens == n

def test_stop_string_split_across_chunks_is_held_back():
    from edgespec.stops import StopStrings

    s = StopStrings(["END"])
    assert s.feed("abc E") == "abc "  # "E" might start "END": held
    assert s.feed("N") == ""
    assert s.feed("Dx") == "" and s.hit
    t = StopStrings(["END"])
    assert t.feed("xE") == "x" and t.feed("Q") == "EQ" and t.flush("E") == "E"


@pytest.mark.parametrize("drafter", ["chain3", "tree8"])
def test_chat_turns_reuse_the_kv_cache(engine, demo_bundle, drafter):
    """Turn 2 extends turn 1's conversation: its prefill feeds only the new tokens, and
    the answer equals a fresh engine's, which prefills everything."""
    history = [{"role": "user", "content": "Write a Python function `flatten`."}]
    first = engine.generate(engine.tokenizer.encode_chat(history), max_new_tokens=24,
                            **DRAFTERS[drafter])
    history += [{"role": "assistant", "content": first.text},
                {"role": "user", "content": "Now write `unflatten`."}]
    ids = engine.tokenizer.encode_chat(history)
    second = engine.generate(ids, max_new_tokens=24, **DRAFTERS[drafter])
    assert second.stats.reused_tokens > len(engine.tokenizer.encode_chat(history[:1])) - 2
    fresh = edgespec.load(demo_bundle).generate(ids, max_new_tokens=24, **DRAFTERS[drafter])
    assert fresh.stats.reused_tokens == 0
    assert second.token_ids == fresh.token_ids


def test_a_different_prompt_reuses_nothing_wrongly(engine):
    a = engine.generate("def alpha(x):", max_new_tokens=16, mode="ar")
    b = engine.generate("class Beta:", max_new_tokens=16, mode="ar")
    again = engine.generate("def alpha(x):", max_new_tokens=16, mode="ar")
    assert again.token_ids == a.token_ids and b.stats.reused_tokens <= 1


def test_submit_runs_in_a_worker_with_callbacks(engine):
    chunks, done = [], []
    job = engine.submit(PROMPTS[0], max_new_tokens=30, on_text=chunks.append,
                        on_done=done.append)
    result = job.result(timeout=60)
    assert job.done() and done == [result]
    assert "".join(chunks) == result.text == engine.generate(PROMPTS[0], max_new_tokens=30).text


def test_a_callback_that_raises_fails_its_job_and_frees_the_engine(engine):
    def broken(chunk):
        raise ZeroDivisionError("the UI broke")

    job = engine.submit(PROMPTS[0], max_new_tokens=30, on_text=broken)
    with pytest.raises(ZeroDivisionError):
        job.result(timeout=60)  # the job keeps the error, and with it its traceback
    after = engine.submit(PROMPTS[0], max_new_tokens=8)  # before: waited forever
    assert after.result(timeout=60).token_ids == engine.generate(
        PROMPTS[0], max_new_tokens=8).token_ids
    errors = []
    failing_done = engine.submit(PROMPTS[0], max_new_tokens=4, on_done=broken,
                                 on_error=errors.append)
    with pytest.raises(ZeroDivisionError):
        failing_done.result(timeout=60)
    assert errors == [] and engine.generate("x", max_new_tokens=2).token_ids


def test_submit_refuses_a_bad_prompt_at_once_and_reports_worker_errors():
    engine = edgespec.load()
    with pytest.raises(EdgespecError, match="shorten the prompt"):
        engine.submit("x " * 600, max_new_tokens=4)  # before: raised in the worker only
    running = engine.submit(PROMPTS[1], max_new_tokens=400, mode="ar")
    while not engine._owner:
        pass
    errors, done = [], []
    queued = engine.submit(PROMPTS[0], max_new_tokens=4, on_done=done.append,
                           on_error=errors.append)
    engine.close()
    running.result(timeout=60)
    with pytest.raises(EdgespecError, match="was closed"):
        queued.result(timeout=60)
    assert done == [] and len(errors) == 1 and "was closed" in str(errors[0])


def test_jobs_are_serialized_and_cancel_their_own_generation(engine):
    long = engine.submit(PROMPTS[1], max_new_tokens=400, mode="ar")
    short = engine.submit(PROMPTS[0], max_new_tokens=8)
    long.cancel()
    assert long.result(timeout=60).finish_reason == "cancelled"
    assert short.result(timeout=60).finish_reason in ("length", "stop")  # not cancelled
    with pytest.raises(EdgespecError, match="temperature"):
        engine.submit("x", temperature=-1)


def test_example_script_runs():
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}  # works installed or from the checkout
    out = subprocess.run([sys.executable, str(REPO / "examples" / "desktop_worker.py")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "tokens per target pass" in out.stdout


@pytest.mark.parametrize("profile", ["cuda", "dml"])
def test_gpu_profile_bundles_run_their_cache_paths_on_the_cpu_ep(tmp_path, demo_target,
                                                                 demo_draft, profile):
    """fp16 graphs of the GPU profiles, including dml's concatenated KV cache with its
    rollback and tree compaction, decoded by the engine on the CPU EP. There they are not
    exact (ONNX Runtime's one-row kernels), so the engine decodes AR unless told
    otherwise, and refuses the other modes; allowed, these prompts still match AR."""
    from edgespec.export import export
    from tests.test_cli import assert_user_error, run

    export(demo_target, tmp_path / "b", draft=demo_draft, precision="fp16",
           ep_profile=profile)
    strict = edgespec.load(tmp_path / "b", device="cpu")
    assert strict.default_mode == "ar" and not strict.exact
    assert strict.generate(PROMPTS[0], max_new_tokens=8).stats.mode == "ar"
    with pytest.raises(EdgespecError, match=f"exported for the {profile} profile"):
        strict.generate(PROMPTS[0], max_new_tokens=8, mode="lookup")
    assert_user_error(run("generate", "x", "--model", str(tmp_path / "b"), "--mode", "spec"),
                      "re-export it with --ep-profile cpu")
    gpu_engine = edgespec.load(tmp_path / "b", device="cpu", allow_inexact=True)
    for prompt in PROMPTS[:3]:
        ar = gpu_engine.generate(prompt, max_new_tokens=32, mode="ar")
        for drafter in ("chain3", "tree8"):
            spec = gpu_engine.generate(prompt, max_new_tokens=32, **DRAFTERS[drafter])
            assert spec.token_ids == ar.token_ids, (prompt, drafter)
