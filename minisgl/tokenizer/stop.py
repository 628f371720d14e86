"""Stop strings matched in linear time, however long the text held back.

Contract: `StopStrings(stops)` prepares a request's stop strings once (a KMP failure table
each; every choice of the request shares them). `state()` is a choice's matching state:
for each stop string, how many of its first characters the output ends with.
`scan(state, text, armed)` advances the state over new text and returns, for the first
character of `text` that completes a stop string, the index just past it and that stop
string's length (the longest, when several end there): the output is cut where that stop
string begins. None if none completes. A stop string that completes while not `armed`
(min_tokens not yet out) is passed over and matching goes on. `held(state)` is how many characters at the end of the output could
still begin a stop string: they wait. Each character costs O(1) per stop string (amortised),
so a long stop string whose start the output keeps matching costs no more per token than
a short one.
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.fails = [_failure(s) for s in stops]

    def state(self) -> list[int]:
        return [0] * len(self.stops)

    # --8<-- [start:scan]
    def scan(self, state: list[int], text: str, armed: bool) -> tuple[int, int] | None:
        """Advance over `text`; (end in text, stop length) of the first stop completed."""
        for i, c in enumerate(text):
            done = 0  # the longest stop string completed by this character
            for j, s in enumerate(self.stops):
                k, fail = state[j], self.fails[j]
                while k and c != s[k]:
                    k = fail[k - 1]
                if c == s[k]:
                    k += 1
                if k == len(s):
                    done = max(done, k)
                    k = fail[k - 1]  # matching goes on (overlaps included)
                state[j] = k
            if done and armed:  # of those ending here, the one that began first
                return i + 1, done
        return None

    # --8<-- [end:scan]

    @staticmethod
    def held(state: list[int]) -> int:
        return max(state, default=0)
