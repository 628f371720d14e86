"""What an answer waiting in the API server holds (server/memory.py): the count the caps
check is the memory the pieces and logprobs really take (tracemalloc), and not
far from it (within what the allocator rounds up); the encoded size it replaced was four times and more too low."""

from __future__ import annotations

import tracemalloc

from minisgl.message import TokenInfo
from minisgl.server.memory import logprobs_bytes, text_bytes


def _held(make) -> tuple[int, object]:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = make()
        return tracemalloc.get_traced_memory()[0] - before, kept
    finally:
        tracemalloc.stop()


def test_one_character_pieces_are_counted_as_the_objects_they_are():
    taken, pieces = _held(lambda: [chr(0x4E00 + i % 5000) for i in range(20_000)])
    counted = sum(text_bytes(p) for p in pieces)
    encoded = sum(len(p.encode()) for p in pieces)
    assert 0.9 * taken <= counted <= 1.5 * taken  # the allocator rounds each object up a little
    assert counted > 4 * encoded  # what the cap used to count


def test_logprobs_are_counted_as_the_objects_they_are():
    def make():
        return [
            TokenInfo(f"t{i}", f"t{i}".encode(), -0.5 * i, i,
                      [(f"a{i}{j}", f"a{i}{j}".encode(), -1.0 * j) for j in range(5)])
            for i in range(5_000)
        ]  # fmt: skip

    taken, infos = _held(make)
    assert 0.9 * taken <= logprobs_bytes(infos) <= 1.5 * taken
