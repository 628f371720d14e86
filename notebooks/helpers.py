"""Helpers for the notebooks (run with notebooks/ as the working directory).

- `FakeBackend`, `make_frontend`, `listening`: the stand-in for the tokenizer worker that
  the tests use too (`minisgl.testing.fakes`), so a notebook drives the real
  FrontendManager with replies it injects itself.
- `Server`: the real three-process server (`python -m minisgl`) on a free port, with
  /debug/lifecycle at hand (`minisgl.testing.server.RunningServer`); stopped by `stop()`
  or, at the latest, when the kernel exits.
- `show(fig)`: displays a matplotlib figure drawn with the Agg backend (no display needed).
"""

from __future__ import annotations

import atexit
import io

import matplotlib

matplotlib.use("Agg")  # draw off-screen: works in CI without a display

import matplotlib.pyplot as plt  # noqa: E402

from minisgl.message import TokenizeMsg  # noqa: E402
from minisgl.testing.fakes import FakeBackend, listening, make_frontend  # noqa: E402, F401
from minisgl.testing.server import RunningServer  # noqa: E402


# ---------------------------------------------------------------- plots
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
    """/debug/lifecycle as one flat row: the per-uid counters of every component."""
    sched = state["scheduler"]
    return {
        "frontend.requests": state["frontend"]["requests"],
        "frontend.pending_bytes": state["frontend"]["pending_bytes"],
        "tokenizer.decode_states": state["tokenizer"]["decode_states"],
        "scheduler.pending": sched["pending"],
        "scheduler.running": sched["running"],
        "scheduler.table_slots_used": sched["table_slots_used"],
        "scheduler.kv_pages_used": sched["kv_pages_used"],
    }


# ---------------------------------------------------------------- timelines
PROCESSES = ("api", "tokenizer", "scheduler")
PHASE_COLOURS = {"queued": "#f2c14e", "prefill": "#4e79a7", "decode": "#59a14f"}
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
                color=PHASE_COLOURS[name], label=name)  # fmt: skip
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
    ax.set_yticks(list(lanes.values()), [p for p in lanes])
    ax.set_ylim(-0.7, len(PROCESSES) - 0.3)
    ax.set_xlabel("seconds since the request arrived")
    ax.set_title(title or f"{timeline['request_id']} ({timeline['state']})", loc="left")
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="lower right", fontsize=8, ncols=3)
    return ax.figure
