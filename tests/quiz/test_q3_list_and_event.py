"""Q3：ack_map 和 event_map 分别承担什么职责？为什么只使用其中一个不够？

答：列表（minisgl 里是每个 uid 的 `ReplyBuffer`）存放"已经到达、还没被取走"的回复内容；
事件（`asyncio.Event`）只负责叫醒等这个 uid 的协程。
- 只有事件：事件是一个标志位，不装数据。监听协程最多只能在某个位置留下一条回复，消费者
  还没运行时第二条回复到来，就把第一条覆盖掉了——内容丢失（`naive.EventOnlyManager`）。
- 只有列表：数据不丢，但没有人能叫醒消费者，它只能隔一会儿来看一次（轮询）：看得勤就空转
  耗 CPU，看得少就增加延迟（`naive.ListOnlyManager`）。
- 两者一起（minisgl 的 FrontendManager）：每次唤醒都有东西可取，一条不丢，空闲时消费者
  根本不被调度。

三个管理器收到同一份回复脚本：两条回复在消费者运行之前先后到达，随后空闲一段，再来一条，
最后是结束回复。
"""

from __future__ import annotations

import asyncio

import pytest
from naive import EventOnlyManager, ListOnlyManager

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.frontend import FrontendManager
from minisgl.testing.fakes import FakeBackend, listening, settle

pytestmark = pytest.mark.q3

IDLE = 30  # loop iterations with nothing arriving (no timers: counts, not seconds)


async def play_script(backend: FakeBackend, uid: int) -> None:
    backend.inject(UserReply(uid, "KV", completion_tokens=1))
    backend.inject(UserReply(uid, " Cache", completion_tokens=2))  # before the consumer ran
    await settle(IDLE)
    backend.inject(UserReply(uid, " 是", completion_tokens=3))
    await settle(IDLE)
    backend.inject(UserReply(uid, "缓存", finished=True, finish_reason="stop", completion_tokens=4))


async def run_naive(cls, **kw) -> tuple[object, str, int]:
    """Consume one request on a naive manager; return it, the text and the wake-ups taken."""
    backend = FakeBackend()
    manager = cls(backend.send, backend.recv, **kw)
    uid = manager.new_user()
    listener = asyncio.create_task(manager.listen())
    text, wakeups = "", 0
    producer = asyncio.create_task(play_script(backend, uid))
    async for reply in manager.wait_for_ack(uid):
        wakeups += 1
        text += reply.incremental_output
        if reply.finished:
            break
    await producer
    listener.cancel()
    return manager, text, wakeups


async def test_an_event_alone_cannot_carry_two_replies_one_is_lost():
    _, text, wakeups = await run_naive(EventOnlyManager)
    assert text == " Cache 是缓存"  # "KV" was overwritten before anyone took it
    assert wakeups == 3


async def test_a_list_alone_keeps_every_reply_but_the_consumer_must_poll():
    # poll as often as the loop allows (a real one naps: less CPU, more latency)
    manager, text, _ = await run_naive(ListOnlyManager, poll=lambda: asyncio.sleep(0))
    assert text == "KV Cache 是缓存"
    # 4 replies, yet the consumer looked dozens of times (once per loop iteration while
    # idle), and nine looks in ten found nothing
    assert manager.polls > IDLE and manager.empty_polls > 0.9 * manager.polls


async def test_list_and_event_together_every_reply_one_wait_per_wakeup():
    backend = FakeBackend()
    frontend = FrontendManager(backend.send, backend.recv)
    async with listening(frontend):
        async with frontend.request(lambda uid: TokenizeMsg(uid, SamplingParams())) as state:
            producer = asyncio.create_task(play_script(backend, state.uid))
            texts = [out.text async for out in frontend.wait_for_ack(state)]
            await producer
    assert "".join(texts) == "KV Cache 是缓存"  # nothing lost
    # one wait per wake-up, each with news: the two early replies came out together
    assert texts == ["KV Cache", " 是", "缓存"]
    assert frontend.states == {}
