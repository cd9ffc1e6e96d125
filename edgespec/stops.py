"""Stop strings: cut generated text at the first one, in time linear in the text.

Each stop string runs a Knuth-Morris-Pratt automaton over the characters as they are
decoded; its state is the longest prefix of that stop which ends the text so far, so a
stop split across tokens is still found, and exactly the text that might begin one is
held back from the stream. The naive way (test every prefix of every stop against the
tail after each token) costs the square of a stop's length per token: with a
200,000-character stop that was most of a second per token.
"""

from __future__ import annotations

from collections.abc import Sequence

# OpenAI accepts up to 4 stop sequences; a stop is a marker, not a document.
MAX_STOPS = 4
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str]) -> str | None:
    """What is wrong with these stop strings, in one clause, or None."""
    if isinstance(stops, str) or not isinstance(stops, Sequence):
        return f"stop must be a string or a list of strings, not {stops!r}"
    if len(stops) > MAX_STOPS:
        return f"at most {MAX_STOPS} stop strings are allowed, got {len(stops)}"
    if any(not isinstance(s, str) for s in stops):
        return "stop strings must be text"
    if any(not s for s in stops):
        return "a stop string must not be empty (it would end every answer before it began)"
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        return (f"a stop string may be at most {MAX_STOP_CHARS} characters, "
                f"got one of {longest}")
    return None


def _failure(stop: str) -> list[int]:
    """KMP: for each prefix of `stop`, the length of its longest proper border."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """Feed text deltas, get back what may be emitted; `hit` once a stop string appeared
    (the text is then cut where it began, and the stop itself is never emitted)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.held = ""
        self.hit = False

    def feed(self, delta: str) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else delta
        text = self.held + delta
        base = len(self.held)
        for i, ch in enumerate(delta):
            for n, stop in enumerate(self.stops):
                k = self._state[n]
                while k and stop[k] != ch:
                    k = self._fail[n][k - 1]
                if stop[k] == ch:
                    k += 1
                self._state[n] = k
            done = [len(s) for s, k in zip(self.stops, self._state, strict=True) if k == len(s)]
            if done:  # several end here: cut where the longest begins
                self.hit, self.held = True, ""
                return text[:base + i + 1 - max(done)]
        keep = max(self._state)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self, delta: str) -> str:
        """The last delta: nothing more can complete a stop, so release what was held."""
        out = self.feed(delta)
        if not self.hit:
            out += self.held
        self.held = ""
        return out
