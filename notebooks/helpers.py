"""Helpers for the notebooks (run with notebooks/ as the working directory).

- Makes `import minisgl` work from a checkout, installed or not.
- `FakeBackend`: a tiny stand-in for the tokenizer worker, the far side of a
  FrontendManager's two channels (a copy of the idea in tests/fakes.py, so that the
  notebooks do not import from tests/).
- `Server`: the real three-process server (`python -m minisgl`) on a free port, with
  /debug/lifecycle at hand (the tests' `RunningServer`); stopped by `stop()` or, at the
  latest, when the kernel exits.
- `show(fig)`: displays a matplotlib figure drawn with the Agg backend (no display needed).
"""

from __future__ import annotations

import asyncio
import atexit
import io
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw off-screen: works in CI without a display

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):  # minisgl from a checkout; the tests' server harness
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import matplotlib.pyplot as plt  # noqa: E402
from server_process import RunningServer  # noqa: E402

from minisgl.message import AbortMsg, TokenizeMsg, UserReply  # noqa: E402
from minisgl.server.frontend import FrontendManager  # noqa: E402

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


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


# ---------------------------------------------------------------- a fake tokenizer worker
class FakeBackend:
    """Records what the frontend sends; hands `listen()` whatever the notebook injects."""

    def __init__(self) -> None:
        self.sent: list = []
        self.queue: asyncio.Queue = asyncio.Queue()

    def send(self, msgs: list) -> None:
        self.sent.extend(msgs)

    async def recv(self) -> list:
        return await self.queue.get()

    def inject(self, *replies: UserReply) -> None:
        """Deliver `replies` as one batch, as one ZMQ frame would."""
        self.queue.put_nowait(list(replies))

    def aborts(self) -> list[int]:
        return [m.uid for m in self.sent if isinstance(m, AbortMsg)]


def make_frontend(**kw) -> tuple[FrontendManager, FakeBackend]:
    backend = FakeBackend()
    return FrontendManager(backend.send, backend.recv, **kw), backend


@asynccontextmanager
async def listening(manager):
    """Run `manager.listen()` for the duration of the block."""
    task = asyncio.create_task(manager.listen())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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
