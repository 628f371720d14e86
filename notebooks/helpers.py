"""Helpers for the notebooks (run with notebooks/ as the working directory).

- `FakeBackend`, `make_frontend`, `listening`: the stand-in for the tokenizer worker that
  the tests use too (`minisgl.testing.fakes`), so a notebook drives the real
  FrontendManager with replies it injects itself.
- `Server`: the real three-process server (`python -m minisgl`) on a free port, with
  /debug/lifecycle at hand (`minisgl.testing.server.RunningServer`); stopped by `stop()`
  or, at the latest, when the kernel exits.
- `show(fig)`: displays a matplotlib figure drawn with the Agg backend (no display needed).
  Figures are labelled in Chinese, drawn with the font shipped in notebooks/fonts/ (Noto
  Sans CJK SC cut down to the characters the notebooks use, `CJK_FONT`), with matplotlib's
  DejaVu Sans for anything else: no font need be installed. A character in neither makes
  matplotlib warn "Glyph ... missing from font(s)" on stderr, which fails the site's test;
  notebooks/fonts/make_subset.py adds new characters to the font.
- Log records of minisgl (a frontend's warning about a slow client, say) are printed to
  the notebook's stdout, as one line each, rather than to stderr.
- `checks`: the exercises' checks (notebooks/checks.py), imported here for the notebooks.
"""

from __future__ import annotations

import atexit
import io
import logging
import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw off-screen: works in CI without a display

import checks  # noqa: E402, F401  (the notebooks' `checks.NAME(...)` cells)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import font_manager  # noqa: E402

from minisgl.message import TokenizeMsg  # noqa: E402
from minisgl.testing.fakes import FakeBackend, listening, make_frontend  # noqa: E402, F401
from minisgl.testing.server import (  # noqa: E402
    ZERO_FRONTEND,
    ZERO_SCHEDULER,
    ZERO_TOKENIZER,
    RunningServer,
)

# ---------------------------------------------------------------- plots
# the shipped subset, never a system font: the figures look the same on every machine
CJK_FONT = Path(__file__).resolve().parent / "fonts" / "NotoSansSC-minisgl.otf"
font_manager.fontManager.addfont(CJK_FONT)
CJK_FAMILY = font_manager.FontProperties(fname=CJK_FONT).get_name()
plt.rcParams["font.family"] = [CJK_FAMILY, "DejaVu Sans"]
plt.rcParams["axes.unicode_minus"] = False  # "-" for negative numbers: the subset has no U+2212
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets

_log = logging.StreamHandler(sys.stdout)
_log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
logging.getLogger("minisgl").addHandler(_log)
logging.getLogger("minisgl").propagate = False  # printed once, to stdout


def show(fig) -> None:
    """Display `fig` as a PNG in the notebook (or do nothing outside one), then close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    try:
        from IPython.display import Image, display
    except ImportError:
        return
    display(Image(buf.getvalue()))


def prompt(text: str = "什么是 KV Cache？"):
    """A make_msg for `frontend.request`."""
    from minisgl.core import SamplingParams

    return lambda uid: TokenizeMsg(uid, SamplingParams(), text=text)


# ---------------------------------------------------------------- the real server
class Server(RunningServer):
    """`python -m minisgl --device cpu` on a free port (the embedded default model): the
    tests' RunningServer, stopped at the latest when the kernel exits."""

    def __init__(self, *extra: str) -> None:
        super().__init__(None, *extra)
        self.model = self.model_name
        atexit.register(self.stop)  # a notebook that fails halfway leaves no server behind

    def chat_body(self, content: str, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], **extra}


def flat_lifecycle(state: dict) -> dict[str, int]:
    """/debug/lifecycle as one flat row: every per-uid counter of every component (the
    same ones the tests' zero check reads, so a counter added there shows here too)."""
    parts = {"frontend": ZERO_FRONTEND, "tokenizer": ZERO_TOKENIZER, "scheduler": ZERO_SCHEDULER}
    return {f"{part}.{key}": state[part][key] for part, zero in parts.items() for key in zero}


# ---------------------------------------------------------------- timelines
PROCESSES = ("api", "tokenizer", "scheduler")
PHASE_COLOURS = {"queued": "#f2c14e", "prefill": "#4e79a7", "decode": "#59a14f"}
PHASE_NAMES = {"queued": "排队", "prefill": "prefill", "decode": "decode"}
LANE_NAMES = {"api": "API Server", "tokenizer": "Tokenizer Worker", "scheduler": "Scheduler"}
END_COLOURS = {"finished": "#2e7d32", "aborted": "#e15759", "error": "#b71c1c"}


def _phases(events: list[dict]) -> list[tuple[str, float, float]]:
    """The scheduler's phases of one timeline: (name, start, end) in seconds."""
    sched = [e for e in events if e["process"] == "scheduler"]
    at = {}
    for e in sched:
        at.setdefault(e["event"], e["t"])
    end = next((e["t"] for e in sched if e["event"] in END_COLOURS), None)
    cuts = [("queued", at.get("queued")), ("prefill", at.get("prefill", at.get("first_token"))),
            ("decode", at.get("first_token")), (None, end)]  # fmt: skip
    cuts = [(name, t) for name, t in cuts if t is not None]
    return [(name, t, cuts[i + 1][1]) for i, (name, t) in enumerate(cuts[:-1]) if name]


def draw_timeline(timeline: dict, ax=None, title: str | None = None):
    """One request's timeline from GET /debug/requests: a lane per process, the
    scheduler's phases as bars, every event as a dot, each process's end as a marker
    (green: finished; red: aborted or error, with who or what ended it)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 2.4))
    lanes = {p: i for i, p in enumerate(reversed(PROCESSES))}
    for name, start, end in _phases(timeline["events"]):
        ax.barh(lanes["scheduler"], end - start, left=start, height=0.5,
                color=PHASE_COLOURS[name], label=PHASE_NAMES[name])  # fmt: skip
    for e in timeline["events"]:
        y = lanes[e["process"]]
        if e["event"] in END_COLOURS:
            colour = END_COLOURS[e["event"]]
            ax.plot(e["t"], y, marker="X" if e["event"] != "finished" else "|", ms=14,
                    mew=2.5, color=colour, zorder=5)  # fmt: skip
            why = e.get("by") or e.get("code") or e.get("kind") or e.get("reason") or ""
            ax.annotate(f"{e['event']} {why}".strip(), (e["t"], y), xytext=(6, 7),
                        textcoords="offset points", fontsize=8, color=colour)  # fmt: skip
        elif e["event"] != "decode":
            ax.plot(e["t"], y, "o", ms=4, color="#333", zorder=4)
    ax.set_yticks(list(lanes.values()), [LANE_NAMES[p] for p in lanes])
    ax.set_ylim(-0.7, len(PROCESSES) - 0.3)
    ax.set_xlabel("自请求到达起的秒数")
    ax.set_title(title or f"{timeline['request_id']} ({timeline['state']})", loc="left")
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="lower right", fontsize=8, ncols=3)
    return ax.figure
