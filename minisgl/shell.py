"""`python -m minisgl --shell`: an interactive chat in the terminal, over the same worker
processes and the same FrontendManager as the HTTP server (no HTTP in between).

Contract: the answer streams as it is generated. Ctrl-C during an answer cancels just that
answer: its request scope exits, AbortMsg goes to the workers (the reference's shell never
sent it), and the prompt comes back; the unanswered question is dropped from the history.
`/reset` clears the history, `/lifecycle` prints every component's live per-request state,
`/exit` or Ctrl-D quits. Ctrl-C at the prompt discards the line.

`launch_shell(args)` starts the workers as the server does (server/launch.py's
`running_workers`), runs the shell over them and stops them; a worker that dies ends the
shell with exit status 1 and a line naming it.

Input is read with the event loop's reader on stdin rather than a blocking input() in a
thread, so that Ctrl-C can reach whichever of "the prompt" or "the answer" is active.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from contextlib import aclosing

import msgspec

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg

from .server.args import ServerArgs
from .server.errors import RequestFailed
from .server.frontend import FrontendManager
from .server.launch import connect_frontend
from .server.supervisor import Supervisor, Worker, WorkerStartError

logger = logging.getLogger(__name__)

PROMPT = ">>> "
HELP = "Type a message. /reset clears the history, /lifecycle shows live state, /exit quits."


class LineReader:
    """Complete lines from a file descriptor, via the event loop; None at end of input."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self._partial = b""
        asyncio.get_running_loop().add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        data = os.read(self.fd, 4096)
        if not data:
            asyncio.get_running_loop().remove_reader(self.fd)
            self.lines.put_nowait(None)
            return
        *complete, self._partial = (self._partial + data).split(b"\n")
        for line in complete:
            self.lines.put_nowait(line.decode(errors="replace"))

    def discard_partial(self) -> None:
        self._partial = b""


def _say(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# --8<-- [start:shell_answer]
async def answer(frontend: FrontendManager, history: list[dict], params: SamplingParams) -> str:
    """Stream one answer to stdout and return it; cancelling this coroutine aborts it."""

    def make_msg(uid: int) -> TokenizeMsg:
        return TokenizeMsg(uid, params, messages=list(history))

    pieces: list[str] = []
    async with frontend.request(make_msg) as state:
        async with aclosing(frontend.wait_for_ack(state)) as outputs:
            async for out in outputs:
                if out.error is not None:
                    raise RequestFailed(out.error)
                _say(out.text)
                pieces.append(out.text)
    return "".join(pieces)


# --8<-- [end:shell_answer]


async def run_shell(frontend: FrontendManager, max_tokens: int | None) -> int:
    loop = asyncio.get_running_loop()
    listener = loop.create_task(frontend.listen())
    reader = LineReader(sys.stdin.fileno())
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens)
    history: list[dict] = []
    current: asyncio.Task | None = None

    def on_sigint() -> None:
        if current is not None and not current.done():
            current.cancel()  # just this answer
        else:
            reader.discard_partial()
            _say(f"\n{PROMPT}")

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    _say(f"{HELP}\n{PROMPT}")
    try:
        while (line := await reader.lines.get()) is not None:
            line = line.strip()
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                history.clear()
                _say(f"(history cleared)\n{PROMPT}")
                continue
            if line == "/lifecycle":
                _say(json.dumps(msgspec.to_builtins(await frontend.lifecycle())) + f"\n{PROMPT}")
                continue
            if not line:
                _say(PROMPT)
                continue
            history.append({"role": "user", "content": line})
            current = loop.create_task(answer(frontend, history, params))
            try:
                history.append({"role": "assistant", "content": await current})
                _say("\n")
            except asyncio.CancelledError:
                if not current.cancelled():
                    raise  # the shell itself is being cancelled
                history.pop()  # the question was not answered
                _say("\n(answer cancelled)\n")
            except RequestFailed as failed:  # refused, or ended with an error
                history.pop()
                _say(f"\n(error: {failed.error.message})\n")
            _say(PROMPT)
        _say("\n")
        return 0
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        listener.cancel()


def launch_shell(args: ServerArgs) -> int:
    async def main(supervisor: Supervisor) -> int:
        frontend = connect_frontend(supervisor.channels, args)
        shell = asyncio.get_running_loop().create_task(run_shell(frontend, args.max_tokens))

        def on_exit(worker: Worker) -> None:
            print(
                f"\nthe {worker.name} process died (exit code {worker.process.exitcode})",
                file=sys.stderr,
            )
            shell.cancel()

        supervisor.watch(on_exit)
        try:
            return await shell
        except asyncio.CancelledError:
            return 1

    try:
        with Supervisor(args).running() as supervisor:
            return asyncio.run(main(supervisor))
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1
