"""Real ZMQ over ipc:// in a private temp directory: typed lists of messages round-trip,
reads wait no longer than asked, one read drains every waiting frame in order, and the
directory is private (0700) and removed on exit."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    BackendMsg,
    Codec,
    DetokenizeMsg,
    FrontendMsg,
    StateQueryMsg,
    TokenizerMsg,
    UserMsg,
    UserReply,
)
from minisgl.utils.zmq import AsyncPullQueue, IpcChannels, PullQueue, PushQueue


@pytest.fixture
def channels():
    ch = IpcChannels.create()
    yield ch
    ch.remove()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@contextmanager
def _frontend_queues(channels):
    """The API server's inbox (async) and a sender to it, closed after."""
    inbox = AsyncPullQueue(channels.frontend, FrontendMsg)
    outbox = PushQueue(channels.frontend, FrontendMsg)
    try:
        yield inbox, outbox
    finally:
        outbox.close()
        inbox.close()


def _get_until(inbox: PullQueue, n: int, deadline_s: float = 5.0) -> list:
    """Read until `n` messages came (frames may land a moment after the send returns)."""
    got: list = []
    end = time.monotonic() + deadline_s
    while len(got) < n and time.monotonic() < end:
        got += inbox.get(timeout_ms=100)
    return got


def test_a_list_of_messages_round_trips_with_packed_ids_and_sampling_params(channels, ctx):
    inbox = PullQueue(channels.scheduler, BackendMsg, ctx)
    outbox = PushQueue(channels.scheduler, BackendMsg, ctx)
    params = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=5, stop_token_ids=[1, 2]
    )
    sent = [
        UserMsg.make(1, [0, 5, 511, 2**31 - 1], params),
        AbortBackendMsg(1),
        StateQueryMsg(3),
    ]
    outbox.put(sent)
    got = _get_until(inbox, len(sent))
    assert got == sent
    assert got[0].input_ids == [0, 5, 511, 2**31 - 1]
    assert got[0].sampling_params == params
    assert isinstance(got[0].sampling_params, SamplingParams)
    outbox.close()
    inbox.close()


def test_put_of_an_empty_list_sends_no_frame(channels, ctx):
    inbox = PullQueue(channels.tokenizer, TokenizerMsg, ctx)
    outbox = PushQueue(channels.tokenizer, TokenizerMsg, ctx)
    outbox.put([])
    assert inbox.get(timeout_ms=100) == []
    outbox.close()
    inbox.close()


def test_get_returns_empty_after_the_timeout_when_nothing_came(channels, ctx):
    inbox = PullQueue(channels.tokenizer, TokenizerMsg, ctx)
    start = time.monotonic()
    assert inbox.get(timeout_ms=150) == []
    waited = time.monotonic() - start
    assert 0.1 <= waited < 2.0
    start = time.monotonic()
    assert inbox.get(timeout_ms=0) == []  # a non-blocking read returns at once
    assert time.monotonic() - start < 0.1
    inbox.close()


def test_frames_sent_before_a_get_all_come_back_in_order_from_one_get(channels, ctx):
    inbox = PullQueue(channels.tokenizer, TokenizerMsg, ctx)
    outbox = PushQueue(channels.tokenizer, TokenizerMsg, ctx)
    frames = [[DetokenizeMsg(uid, step) for uid in range(3)] for step in range(5)]
    for frame in frames:
        outbox.put(frame)
    time.sleep(0.3)  # let ZMQ's I/O thread move every frame into the inbox
    got = inbox.get(timeout_ms=1000)
    assert got == [m for frame in frames for m in frame]
    assert inbox.get(timeout_ms=0) == []
    outbox.close()
    inbox.close()


def test_the_ipc_directory_is_private_and_remove_deletes_it(ctx):
    ch = IpcChannels.create()
    try:
        root = Path(ch.root)
        assert root.is_dir()
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert root.stat().st_uid == os.getuid()
        for addr in (ch.frontend, ch.tokenizer, ch.scheduler):
            assert addr.startswith("ipc://") and Path(addr[len("ipc://") :]).parent == root
        assert len({ch.frontend, ch.tokenizer, ch.scheduler}) == 3
        inbox = PullQueue(ch.frontend, FrontendMsg, ctx)  # a bound socket file inside it
        assert any(root.iterdir())
        inbox.close()
    finally:
        ch.remove()
    assert not root.exists()
    ch.remove()  # removing twice is harmless (shutdown paths may overlap)


def test_two_instances_get_separate_directories():
    a, b = IpcChannels.create(), IpcChannels.create()
    try:
        assert a.root != b.root and a.frontend != b.frontend
    finally:
        a.remove()
        b.remove()


async def test_async_pull_queue_receives_every_waiting_frame_in_order(channels):
    with _frontend_queues(channels) as (inbox, outbox):
        first = [UserReply(1, "你好 🚀", prompt_tokens=3, completion_tokens=1)]
        second = [UserReply(1, "!", finished=True, finish_reason="stop"), UserReply(2, "x")]
        outbox.put(first)
        outbox.put(second)
        got = await asyncio.wait_for(inbox.get(), timeout=5)
        while len(got) < 3:  # frames already waiting come with the same get
            got += await asyncio.wait_for(inbox.get(), timeout=5)
        assert got == first + second


async def test_async_pull_queue_get_waits_without_blocking_the_loop(channels):
    with _frontend_queues(channels) as (inbox, outbox):
        pending = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0.05)  # the loop keeps running while get() waits
        assert not pending.done()
        outbox.put([UserReply(7, "late")])
        assert await asyncio.wait_for(pending, timeout=5) == [UserReply(7, "late")]


def _send_raw(addr: str, ctx: zmq.Context, frame: bytes) -> None:
    """A stray sender: one frame that is not a list of this channel's messages."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(addr)
    sock.send(frame)
    sock.close()


# garbage bytes, and well-formed msgpack of another channel's union
BAD_FRAMES = [b"\xc1 not msgpack", Codec(BackendMsg).encode([AbortBackendMsg(5)])]


@pytest.mark.parametrize("bad", BAD_FRAMES, ids=["garbage", "wrong_union"])
def test_a_bad_frame_between_two_good_ones_costs_only_itself(channels, ctx, bad):
    inbox = PullQueue(channels.tokenizer, TokenizerMsg, ctx)
    outbox = PushQueue(channels.tokenizer, TokenizerMsg, ctx)
    outbox.put([DetokenizeMsg(1, 7)])
    time.sleep(0.1)  # keep the three frames in this order
    _send_raw(channels.tokenizer, ctx, bad)
    time.sleep(0.1)
    outbox.put([DetokenizeMsg(1, 8, "stop")])
    time.sleep(0.3)
    assert inbox.get(timeout_ms=1000) == [DetokenizeMsg(1, 7), DetokenizeMsg(1, 8, "stop")]
    outbox.close()
    inbox.close()


@pytest.mark.parametrize("bad", BAD_FRAMES, ids=["garbage", "wrong_union"])
async def test_async_pull_queue_delivers_the_good_frames_around_a_bad_one(channels, bad):
    ctx = zmq.Context()
    try:
        with _frontend_queues(channels) as (inbox, outbox):
            first = [UserReply(1, "a", completion_tokens=1)]
            last = [UserReply(1, "b", finished=True, finish_reason="stop", completion_tokens=2)]
            outbox.put(first)
            await asyncio.sleep(0.1)
            _send_raw(channels.frontend, ctx, bad)
            await asyncio.sleep(0.1)
            outbox.put(last)
            await asyncio.sleep(0.3)  # all three frames wait: one get takes them together
            got = await asyncio.wait_for(inbox.get(), timeout=5)
            assert got == first + last  # the terminal reply is not lost with the bad frame

            _send_raw(channels.frontend, ctx, bad)  # a bad frame alone: get waits past it
            pending = asyncio.ensure_future(inbox.get())
            await asyncio.sleep(0.2)
            assert not pending.done()
            outbox.put([UserReply(2, "c")])
            assert await asyncio.wait_for(pending, timeout=5) == [UserReply(2, "c")]
    finally:
        ctx.destroy(linger=0)
