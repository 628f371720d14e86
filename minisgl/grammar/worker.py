"""The grammar-compile process: `python -m minisgl.grammar.worker`, started by pool.py.

Contract (over its stdin and stdout, frames of a 4-byte big-endian length and msgpack):
- first frame in: `Hello` (the token table, or None for a model without a tokenizer, and
  which compile function to run: `compile_item` unless a test injects a faulty one);
  it builds the token table, then answers `["ready"]`.
- then one `Job` per frame in: its items are compiled in order; before each it says
  `["item", job, i]` (so that a crash or a hang inside item i is blamed on item i), then
  `["done", job, grammar]` with the last item's grammar, or `["error", job, i, message]`
  for the first that fails.
- it exits when its stdin closes or the process that started it (its argument) is gone,
  also in the middle of a compile.
Anything it prints goes to stderr: stdout carries only frames.
"""

from __future__ import annotations

import importlib
import struct
import sys
from typing import BinaryIO

import msgspec

from .compile import GrammarError, TokenTable

_LENGTH = struct.Struct(">I")


class Hello(msgspec.Struct):
    table: TokenTable | None
    compiler: str | None = None  # "module:function"; None: compile.compile_item


class Job(msgspec.Struct, array_like=True):
    id: int
    items: list[tuple[str, str]]  # (kind, text)


def frame(obj) -> bytes:
    data = msgspec.msgpack.encode(obj)
    return _LENGTH.pack(len(data)) + data


class FrameReader:
    """Frames out of a byte stream that arrives in pieces (the pool's non-blocking reads)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._buf)
            if len(self._buf) < _LENGTH.size + n:
                break
            out.append(bytes(self._buf[_LENGTH.size : _LENGTH.size + n]))
            del self._buf[: _LENGTH.size + n]
        return out


def _read(stream: BinaryIO) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    data = stream.read(n)
    return data if len(data) == n else None


def _compiler(name: str | None):
    if name is None:
        from .compile import compile_item

        return compile_item
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _die_with(parent: int) -> None:
    """Exit when the process that started us does, even in the middle of a compile that
    would never end: Linux kills us with it; elsewhere a thread watches."""
    import os
    import signal
    import threading
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server to handle
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    if len(sys.argv) > 1:
        _die_with(int(sys.argv[1]))
    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    hello_data = _read(stdin)
    if hello_data is None:
        return
    hello = msgspec.msgpack.decode(hello_data, type=Hello)
    compile_fn = _compiler(hello.compiler)
    tokenizer = hello.table.build() if hello.table is not None else None

    def say(*reply) -> None:
        out.write(frame(list(reply)))
        out.flush()

    say("ready")
    while (data := _read(stdin)) is not None:
        job = msgspec.msgpack.decode(data, type=Job)
        grammar = None
        for i, (kind, text) in enumerate(job.items):
            say("item", job.id, i)
            try:
                grammar = compile_fn(kind, text, tokenizer)
            except GrammarError as e:
                say("error", job.id, i, str(e))
                break
            except Exception as e:  # the library's own error type, or its bug
                say("error", job.id, i, f"could not be compiled: {type(e).__name__}: {e}")
                break
        else:
            say("done", job.id, grammar)


if __name__ == "__main__":
    main()
