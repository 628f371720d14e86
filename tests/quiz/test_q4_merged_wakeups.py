"""Q4：按 wait → clear → 取出并替换列表 → yield 走一遍消费过程。多次 set() 合并成一次唤醒时，
为什么不会只剩一条回复？

答：Event 是标志位，不是计数器：set() 五次和 set() 一次一样，只换来一次唤醒。但每条回复在
set() 之前已经追加进了该 uid 的缓冲区，唤醒后消费者一次取走缓冲区里的全部内容（minisgl 的
`ReplyBuffer.take()` 把它们合并成一个 `Output`），所以五条都在。clear() 和 take() 之间没有
await，监听协程插不进来；consumer 在 yield 处暂停期间到达的新回复写进已被清空的缓冲区，
并再次 set()，下一轮 wait() 立刻返回。
"""

from __future__ import annotations

import asyncio

import pytest

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.testing.fakes import listening, make_frontend, settle

pytestmark = pytest.mark.q4

PIECES = ["什么", "是 ", "KV", " Cache", "？"]


async def test_an_event_is_a_flag_five_sets_one_wakeup():
    event, woken = asyncio.Event(), 0

    async def waiter():
        nonlocal woken
        while True:
            await event.wait()
            event.clear()
            woken += 1

    task = asyncio.create_task(waiter())
    for _ in range(5):
        event.set()  # no await in between: the waiter cannot run
    await settle()
    assert woken == 1  # five set() calls, one wake-up
    task.cancel()


async def test_several_replies_one_wakeup_every_reply_in_the_output():
    frontend, backend = make_frontend()
    async with listening(frontend):
        async with frontend.request(lambda uid: TokenizeMsg(uid, SamplingParams())) as state:
            uid = state.uid
            for i, piece in enumerate(PIECES):  # five arrivals, five set(), no await between
                backend.inject(UserReply(uid, piece, completion_tokens=i + 1))
            await settle()
            assert state.event.is_set()
            assert state.buffer.pending_bytes == len("".join(PIECES).encode())

            outputs = frontend.wait_for_ack(state)
            # wait (returns at once) -> clear -> take everything -> yield
            out = await anext(outputs)
            assert out.text == "".join(PIECES) and out.completion_tokens == 5
            assert not state.event.is_set()  # cleared
            assert state.buffer.pending_bytes == 0 and frontend.state()["pending_bytes"] == 0

            # suspended at yield: a reply now lands in the emptied buffer and sets the event
            backend.inject(UserReply(uid, "它", completion_tokens=6))
            await settle()
            assert state.event.is_set() and state.buffer.pending_bytes == len("它".encode())
            assert (await anext(outputs)).text == "它"

            # nothing is left over for a phantom wake-up: the next wait really waits
            nxt = asyncio.ensure_future(anext(outputs))
            await settle()
            assert not nxt.done()
            backend.inject(UserReply(uid, "", finished=True, finish_reason="stop"))
            last = await nxt
            assert last.finished and last.text == ""
            await outputs.aclose()
    assert frontend.states == {} and backend.aborts() == []
