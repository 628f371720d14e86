"""Quiz question 3: why a request needs both a reply buffer and a wake-up event.

Checks `ReplyInbox` (exercise q3): two replies delivered before the consumer looks are
both there for `take()`; a consumer waiting on `event` wakes after a delivery; a reply
that only updates counts leaves `event` alone, while the terminal reply sets it even
without text; `take()` returns the text in order and leaves nothing pending.

For contrast, one reply script (two replies before the consumer runs, idle spells, the
end) on the naive managers of notebooks/naive.py, `EventOnlyManager` and
`ListOnlyManager`, and on minisgl's FrontendManager: the text each consumer gets, its
wake-ups, how often it looked.
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
WAKE_TIMEOUT = 1.0  # seconds: a consumer not woken by then never will be


def reply(text: str, tokens: int, last: bool = False) -> UserReply:
    return UserReply(
        0, text, finished=last, finish_reason="stop" if last else None, completion_tokens=tokens
    )


# ---------------------------------------------------------------- exercise q3


def test_replies_delivered_before_the_consumer_looks_are_all_kept(exercise):
    inbox = exercise.ReplyInbox()
    inbox.deliver(reply("KV", 1))
    inbox.deliver(reply(" Cache", 2))  # the consumer has not run in between
    assert inbox.event.is_set(), "送来了两条回复，事件却没有置位"
    taken = inbox.take()
    assert taken.text == "KV Cache", (
        f"消费者来看之前到了两条回复，它拿到的是 {taken.text!r}：事件只是一个标志，"
        "不携带数据，回复必须在缓冲区里等着"
    )
    assert not taken.finished, "还没有送来终止回复"


async def test_a_waiting_consumer_is_woken_by_a_delivery(exercise):
    inbox = exercise.ReplyInbox()
    waiter = asyncio.create_task(inbox.event.wait())
    await settle()
    assert not waiter.done(), "什么都没送来，事件却已经置位"
    inbox.deliver(reply("KV", 1))
    try:
        await asyncio.wait_for(waiter, WAKE_TIMEOUT)
    except asyncio.TimeoutError:
        pytest.fail("送来了一条回复，等在 `event` 上的消费者却永远醒不过来")
    assert inbox.take().text == "KV", "送来的文本取不到"


def test_a_reply_without_news_wakes_nobody(exercise):
    inbox = exercise.ReplyInbox()
    inbox.deliver(reply("", 1))  # e.g. the first byte of a character: counts only
    assert not inbox.event.is_set(), "白白叫醒：消费者什么也取不到"
    assert inbox.take() == ("", False), "没有文本、也没有结束的回复，不留下任何可取的东西"


def test_the_terminal_reply_wakes_even_without_text(exercise):
    inbox = exercise.ReplyInbox()
    inbox.deliver(reply("", 3, last=True))
    assert inbox.event.is_set(), "终止回复即使没有文本，也必须叫醒消费者：否则消费者会永远等下去"
    assert inbox.take().finished, "终止回复已经送到，take() 必须说明这一点"


def test_take_returns_the_text_in_order_and_leaves_nothing_pending(exercise):
    inbox = exercise.ReplyInbox()
    for i, piece in enumerate(["什么", "是 ", "KV"]):
        inbox.deliver(reply(piece, i + 1))
    got = inbox.take().text
    assert got == "什么是 KV", f"take() 必须按顺序返回上次取走之后的全部文本：{got!r}"
    assert inbox.take().text == "", "取走一次之后，文本必须不在了"
    inbox.deliver(reply("？", 4, last=True))
    assert inbox.take() == ("？", True), "终止回复的文本和结束，要一起取到"


# ---------------------------------------------------------------- the contrast


async def play_script(backend: FakeBackend, uid: int) -> None:
    """Two replies before the consumer runs, an idle spell, one more, another, the end."""
    backend.inject(UserReply(uid, "KV", completion_tokens=1))
    backend.inject(UserReply(uid, " Cache", completion_tokens=2))
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
    async for item in manager.wait_for_ack(uid):
        wakeups += 1
        text += item.incremental_output
        if item.finished:
            break
    await producer
    listener.cancel()
    return manager, text, wakeups


async def test_contrast_event_only_manager():
    _, text, wakeups = await run_naive(EventOnlyManager)
    assert text == " Cache 是缓存"  # where is "KV"?
    assert wakeups == 3


async def test_contrast_list_only_manager():
    # poll as often as the loop allows (a real one naps: less CPU, more latency)
    manager, text, _ = await run_naive(ListOnlyManager, poll=lambda: asyncio.sleep(0))
    assert text == "KV Cache 是缓存"
    # 4 replies; how often did the consumer look, and how often for nothing?
    assert manager.polls > IDLE and manager.empty_polls > 0.9 * manager.polls


async def test_contrast_minisgl_frontend_manager():
    backend = FakeBackend()
    frontend = FrontendManager(backend.send, backend.recv)
    async with listening(frontend):
        async with frontend.request(lambda uid: TokenizeMsg(uid, SamplingParams())) as state:
            producer = asyncio.create_task(play_script(backend, state.uid))
            texts = [out.text async for out in frontend.wait_for_ack(state)]
            await producer
    assert "".join(texts) == "KV Cache 是缓存"
    assert texts == ["KV Cache", " 是", "缓存"]
    assert frontend.states == {}
