"""Stop-string matching cost per token as the held-back text grows.

The adversarial case: a stop string of L characters whose first L - 1 the output keeps
matching, one character per token, so the tokenizer worker holds back more and more text.
For L in 10, 100 and 1000 (the cap), this times the tokenizer worker's per-token stop
handling (`DetokenizeManager._apply_stop`, minisgl/tokenizer/stop.py) over the last tenth
of the L tokens, where the held-back text is longest, and the same for the quadratic
matcher minisgl had before (every prefix of every stop string compared with the end of the
held text, each token), measured in the same run. Flat per-token cost in L is the target.

    python benchmarks/stop_strings.py
"""

from __future__ import annotations

import time

from common import script_parser, write_json

from minisgl.tokenizer.detokenize import ChoiceState, DecodeState, DetokenizeManager
from minisgl.tokenizer.stop import StopStrings


def linear(stop: str, tokens: int) -> list[float]:
    state = DecodeState(stop=StopStrings((stop,)))
    choice = ChoiceState(stop_state=state.stop.state())
    times = []
    for i in range(tokens):
        choice.tokens = i + 1
        t = time.perf_counter()
        DetokenizeManager._apply_stop(state, choice, "x", False)
        times.append(time.perf_counter() - t)
    assert choice.held_len == tokens  # everything held: it could still be the stop string
    return times


def quadratic(stop: str, tokens: int) -> list[float]:
    """The matcher before: hold back the longest end of the text that begins a stop string,
    found by comparing every prefix of the stop string with the end of the held text."""
    held, times = "", []
    for _ in range(tokens):
        t = time.perf_counter()
        text = held + "x"
        if text.find(stop) < 0:
            hold = max(
                (k for k in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:k])),
                default=0,
            )
            held = text[len(text) - hold :]
        times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[10, 100, 1000])
    args = p.parse_args(argv)
    rows = []
    print(f"{'stop length':>11}  {'linear us/token':>15}  {'quadratic us/token':>18}")
    for length in args.lengths:
        stop = "x" * (length - 1) + "!"
        tail = max(1, length // 10)
        ours = sorted(linear(stop, length - 1)[-tail:])
        before = sorted(quadratic(stop, length - 1)[-tail:])
        row = {
            "stop_length": length,
            "linear_us": 1e6 * ours[len(ours) // 2],
            "quadratic_us": 1e6 * before[len(before) // 2],
        }
        rows.append(row)
        print(f"{length:>11}  {row['linear_us']:>15.2f}  {row['quadratic_us']:>18.2f}")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
