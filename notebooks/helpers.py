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
