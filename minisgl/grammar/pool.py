"""GrammarCompiler: a small pool of grammar-compile processes, so that what a user sends
(a JSON schema, tool parameters, a grammar) is compiled where a crash or a stall costs only
the request that sent it.

Contract:
- `GrammarCompiler(table, workers, timeout)` starts `workers` compile processes
  (`python -m minisgl.grammar.worker`), each building the token table once.
- `submit(key, items)` queues one job: `items` are (kind, text) constraints compiled in
  order (a request's tool schemas, then its constraint); `cancel(key)` forgets it. Never
  blocks: a job waits for a free process, and its time limit runs from when one takes it.
- `collect()` (non-blocking) returns a `Compiled` for each job that ended: the grammar of
  its last item, or the index of the item that failed and why. A job whose process
  crashed (a segfault in native code) or outran `timeout` seconds fails with that reason;
  the process is killed and replaced, and the pool goes on serving.
- `fds()` and `wait_ms()` let the owner's event loop sleep until a process has something
  to say or a time limit falls due; `compile(items)` does it all for one job, blocking
  (offline use).
- `close()` stops every process. A process whose owner dies is killed with it (Linux's
  parent-death signal; elsewhere it exits when its stdin closes or its parent changes).

A process that cannot start (it exits before it is ready) is retried with a back-off;
meanwhile jobs fail at once, saying so, rather than wait.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import msgspec

from .compile import GrammarError, TokenTable
from .worker import FrameReader, Hello, Job, frame

START_RETRY_S = 5.0  # after a process failed to start, before the next try


@dataclass
class Compiled:
    key: Hashable
    grammar: str | None = None  # the last item's grammar, when every item compiled
    failed: int | None = None  # else the index of the item that did not
    error: str | None = None  # and why


@dataclass
class _Running:
    key: Hashable
    job: int
    deadline: float
    item: int = 0  # the item being compiled now (the process says when it moves on)


class _Process:
    """One compile process: its pipes, what it was asked, and what it said so far."""

    def __init__(self, hello: bytes) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minisgl.grammar.worker", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.out_fd = self.proc.stdout.fileno()
        self.in_fd = self.proc.stdin.fileno()
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.in_fd, False)
        self.reader = FrameReader()
        self.outbox = bytearray(hello)  # frames not yet written (the pipe may be full)
        self.ready = False
        self.running: _Running | None = None
        self.flush()

    def flush(self) -> None:
        while self.outbox:
            try:
                n = os.write(self.in_fd, self.outbox)
            except BlockingIOError:
                return
            except OSError:  # it died: read() will say so
                self.outbox.clear()
                return
            del self.outbox[:n]

    def read(self) -> tuple[list[list], bool]:
        """What it said since the last call, and whether it has exited."""
        replies: list[list] = []
        while True:
            try:
                data = os.read(self.out_fd, 1 << 16)
            except BlockingIOError:
                return replies, False
            if not data:
                return replies, True
            replies += [msgspec.msgpack.decode(f) for f in self.reader.feed(data)]

    def exit_status(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:  # it closed its stdout but lives on: stop it
            self.proc.kill()
            code = self.proc.wait()
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class GrammarCompiler:
    def __init__(
        self,
        table: TokenTable | None,
        workers: int = 2,
        timeout: float = 5.0,
        compiler: str | None = None,
    ) -> None:
        self.timeout = timeout
        self._hello = frame(Hello(table, compiler))
        # a slot is empty while a process that failed to start waits out its back-off
        self._procs: list[_Process | None] = [_Process(self._hello) for _ in range(workers)]
        self._queue: collections.OrderedDict[Hashable, list[tuple[str, str]]] = (
            collections.OrderedDict()
        )
        self._jobs = 0
        self._cancelled: set[Hashable] = set()
        self._done: list[Compiled] = []
        self._retry_at = 0.0  # when an empty slot gets a new process
        self._start_failure: str | None = None  # why the last process failed to start
        self.crashes = 0  # processes lost to a crash or a time limit since start

    # ---------------------------------------------------------------- the owner's side
    def submit(self, key: Hashable, items: Sequence[tuple[str, str]]) -> None:
        self._queue[key] = list(items)
        self._dispatch()

    def cancel(self, key: Hashable) -> None:
        if self._queue.pop(key, None) is None:
            self._cancelled.add(key)  # running: its answer is dropped when it comes

    def pending(self) -> int:
        """Jobs submitted whose answer has not been collected."""
        return len(self._queue) + len(self._running()) + len(self._done)

    def fds(self) -> list[int]:
        return [p.out_fd for p in self._live()]

    def wait_ms(self, default: int) -> int:
        """How long the owner may sleep before `collect()` has to look again."""
        if self._done:
            return 0
        if any(p.outbox for p in self._live()):
            return 5  # a job still being written to a full pipe
        due = [r.deadline for r in self._running()]
        if any(p is None for p in self._procs):
            due.append(self._retry_at)
        if not due:
            return default
        return max(0, min(default, int((min(due) - time.monotonic()) * 1000) + 1))

    def collect(self) -> list[Compiled]:
        now = time.monotonic()
        for i, proc in enumerate(self._procs):
            if proc is None:
                if now >= self._retry_at:
                    self._procs[i] = _Process(self._hello)
                continue
            proc.flush()
            replies, exited = proc.read()
            for reply in replies:
                self._on_reply(proc, reply)
            if exited:
                self._lost(i, f"the grammar compiler crashed ({proc.exit_status()})")
            elif proc.running is not None and now > proc.running.deadline:
                self._lost(i, f"compiling it took longer than {self.timeout:g} s")
        self._dispatch()
        done, self._done = self._done, []
        return [c for c in done if not self._forget(c.key)]

    def compile(self, items: Sequence[tuple[str, str]]) -> str | None:
        """One job, waited for: its grammar, or GrammarError saying why it failed."""
        key = object()
        self.submit(key, items)
        while True:
            for result in self.collect():
                if result.key is key:
                    if result.error is not None:
                        raise GrammarError(result.error)
                    return result.grammar
            select.select(self.fds(), [], [], self.wait_ms(500) / 1000)

    def close(self) -> None:
        for proc in self._live():
            proc.kill()
        self._procs = []

    # ---------------------------------------------------------------- inside
    def _live(self) -> list[_Process]:
        return [p for p in self._procs if p is not None]

    def _running(self) -> list[_Running]:
        return [p.running for p in self._live() if p.running is not None]

    def _forget(self, key: Hashable) -> bool:
        if key in self._cancelled:
            self._cancelled.discard(key)
            return True
        return False

    def _on_reply(self, proc: _Process, reply: list) -> None:
        tag = reply[0]
        if tag == "ready":
            proc.ready = True
            self._start_failure = None
            return
        running = proc.running
        if running is None or reply[1] != running.job:
            return
        if tag == "item":
            running.item = reply[2]
        elif tag == "done":
            proc.running = None
            self._done.append(Compiled(running.key, grammar=reply[2]))
        elif tag == "error":
            proc.running = None
            self._done.append(Compiled(running.key, failed=reply[2], error=reply[3]))

    def _lost(self, i: int, why: str) -> None:
        """Process i crashed, or is stuck past its time limit: kill it, fail its job with
        `why`, and start another (after a back-off if it never got ready)."""
        proc = self._procs[i]
        proc.kill()
        if proc.running is not None:
            self.crashes += 1
            running = proc.running
            self._done.append(Compiled(running.key, failed=running.item, error=why))
        if proc.ready:
            self._procs[i] = _Process(self._hello)
        else:  # it never got ready: starting it again at once would only fail again
            self._procs[i] = None
            self._retry_at = time.monotonic() + START_RETRY_S
            self._start_failure = why.replace("crashed", "could not start")

    def _dispatch(self) -> None:
        idle = [p for p in self._live() if p.ready and p.running is None]
        while self._queue and idle:
            proc = idle.pop()
            key, items = self._queue.popitem(last=False)
            self._jobs += 1
            proc.running = _Running(key, self._jobs, time.monotonic() + self.timeout)
            proc.outbox += frame(Job(self._jobs, items))
            proc.flush()
        if self._start_failure and not any(p.ready for p in self._live()):
            while self._queue:  # nothing can compile now: say so rather than wait
                key, _ = self._queue.popitem(last=False)
                self._done.append(Compiled(key, failed=0, error=self._start_failure))
