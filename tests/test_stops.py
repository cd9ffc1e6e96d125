"""Stop strings against a brute-force reading, on text fed in arbitrary pieces; and the
top_p floor (issue 17, findings 2 and 13)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edgespec.spec.sampling import SamplingParams, warp
from edgespec.stops import StopStrings, check_stops


def brute_force(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut where the first stop to be completed begins (the longest, if several end at
    the same character)."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[:end - max(len(s) for s in done)], True
    return text, False


alphabet = st.sampled_from("ab\n")


@settings(max_examples=1500, deadline=None)
@given(pieces=st.lists(st.text(alphabet, max_size=5), max_size=12),
       stops=st.lists(st.text(alphabet, max_size=6), max_size=4))
@example(pieces=["ab"], stops=["b", "ab"])  # two end together: the longer one wins
def test_stop_strings_match_brute_force(pieces, stops):
    matcher = StopStrings(stops)
    out = [matcher.feed(p) for p in pieces[:-1]]
    out.append(matcher.flush(pieces[-1] if pieces else ""))
    assert ("".join(out), matcher.hit) == brute_force("".join(pieces), stops)


def test_held_text_is_only_a_possible_stop_start():
    matcher = StopStrings(["</answer>"])
    assert matcher.feed("x = 1 </ans") == "x = 1 "
    assert matcher.feed("wer") == ""  # "</answer" could still complete
    assert matcher.feed("!") == "</answer!"


def test_caps():
    assert check_stops(["a"] * 4) is None and "at most 4" in check_stops(["a"] * 5)
    assert check_stops(["x" * 256]) is None and "256" in check_stops(["x" * 257])


def test_top_p_below_float32_range_keeps_the_best_token():
    logits = np.array([[0.5, 2.0, 1.0], [3.0, -1.0, 0.0]], np.float32)
    for top_p in (1e-46, 5e-324):
        probs = warp(logits, SamplingParams(1.0, 0, top_p))
        assert np.array_equal(probs, np.eye(3)[[1, 0]])
