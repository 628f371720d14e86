"""Q7：调用方在 finished 后提前 break 时，wait_for_ack 的尾部删除是否执行？设计一个不依赖 GPU 的
验证，并说明取消与异常路径还需要哪些清理保证。

答：不执行。break 之后生成器停在 yield 处，没人再推进它；之后无论被显式 aclose() 还是被垃圾
回收，都是在 yield 处抛出 GeneratorExit，循环后面的普通语句一行也不会运行，所以映射残留。
验证不需要 GPU：用参考式的管理器（`naive.RefStyleManager`，清理写在生成器尾部）和一个假的
回复源，消费者在 finished 后 break，然后看 ack_map / event_map 里还剩什么。

minisgl 的做法：请求的前台状态在 `async with frontend.request(...)` 这一个作用域里创建和删除
（try/finally），不依赖生成器跑到尾部。取消和异常路径还需要：
- 离开作用域时如果还没收到终止回复（取消、异常、提前退出），要发 AbortMsg，让 tokenizer worker
  和 scheduler 也释放这个 uid；
- 收到错误回复（它本身就是终止回复）时删除状态，但不必再发 AbortMsg——后端已经不再持有它；
- 之后迟到的回复一律丢弃，不能重新建立状态。
"""

from __future__ import annotations

import asyncio

import pytest
from naive import RefStyleManager

from minisgl.core import SamplingParams
from minisgl.message import ErrorInfo, ErrorKind, TokenizeMsg, UserReply
from minisgl.testing.fakes import FakeBackend, listening, make_frontend, settle

pytestmark = pytest.mark.q7


def make_msg(uid: int) -> TokenizeMsg:
    return TokenizeMsg(uid, SamplingParams())


def replies(uid: int) -> list[UserReply]:
    return [UserReply(uid, "a"), UserReply(uid, "b", finished=True, finish_reason="stop")]


# ---------------------------------------------------------------- the reference-style tail


async def test_reference_style_cleanup_at_the_tail_is_skipped_by_break():
    backend = FakeBackend()
    manager = RefStyleManager(backend.send, backend.recv)
    listener = asyncio.create_task(manager.listen())
    for _ in range(3):  # three requests, each consumer breaks right after `finished`
        uid = manager.new_user()
        backend.inject(*replies(uid))
        acks = manager.wait_for_ack(uid)
        async for ack in acks:
            if ack.finished:
                break
        await acks.aclose()  # even closing it explicitly runs no line after the loop
    listener.cancel()
    assert sorted(manager.ack_map) == sorted(manager.event_map) == [0, 1, 2]  # leaked


async def test_the_tail_runs_only_if_the_consumer_asks_for_one_more_item():
    backend = FakeBackend()
    manager = RefStyleManager(backend.send, backend.recv)
    listener = asyncio.create_task(manager.listen())
    uid = manager.new_user()
    backend.inject(*replies(uid))
    texts = [ack.incremental_output async for ack in manager.wait_for_ack(uid)]  # no break
    listener.cancel()
    assert texts == ["a", "b"] and manager.ack_map == {} and manager.event_map == {}


async def test_reference_style_cancel_leaks_and_tells_the_backend_nothing():
    backend = FakeBackend()
    manager = RefStyleManager(backend.send, backend.recv)
    uid = manager.new_user()

    async def consume():
        async for _ in manager.wait_for_ack(uid):
            pass

    task = asyncio.create_task(consume())
    await settle()
    task.cancel()  # the client went away
    await asyncio.gather(task, return_exceptions=True)
    assert uid in manager.ack_map and uid in manager.event_map
    assert backend.sent == []  # no AbortMsg: the scheduler would keep generating


# ---------------------------------------------------------------- minisgl: one scope per request


async def test_ours_break_after_finished_leaves_nothing_and_needs_no_abort():
    frontend, backend = make_frontend()
    async with listening(frontend):
        for _ in range(3):
            async with frontend.request(make_msg) as state:
                backend.inject(*replies(state.uid))
                async for out in frontend.wait_for_ack(state):
                    if out.finished:
                        break
                assert out.text == "ab"
    assert frontend.states == {} and backend.aborts() == []


async def test_ours_cancel_removes_state_and_sends_abort():
    frontend, backend = make_frontend()
    async with listening(frontend):

        async def serve():
            async with frontend.request(make_msg) as state:
                async for _ in frontend.wait_for_ack(state):
                    pass

        task = asyncio.create_task(serve())
        await settle()
        (uid,) = frontend.states
        backend.inject(UserReply(uid, "a"))
        await settle()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert frontend.states == {} and backend.aborts() == [uid]

        backend.inject(UserReply(uid, "late"))  # a token already on its way
        await settle()
    assert frontend.states == {} and backend.aborts() == [uid]


async def test_ours_an_exception_in_the_consumer_removes_state_and_sends_abort():
    frontend, backend = make_frontend()
    async with listening(frontend):
        with pytest.raises(UnicodeError):
            async with frontend.request(make_msg) as state:
                backend.inject(UserReply(state.uid, "a"))
                async for _ in frontend.wait_for_ack(state):
                    raise UnicodeError("the response could not be written")
    assert frontend.states == {} and backend.aborts() == [state.uid]


async def test_ours_an_error_reply_ends_the_request_without_abort():
    frontend, backend = make_frontend()
    too_long = ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "the prompt is too long")
    async with listening(frontend):
        async with frontend.request(make_msg) as state:
            backend.inject(UserReply(state.uid, finished=True, error=too_long))
            outs = [out async for out in frontend.wait_for_ack(state)]
    assert len(outs) == 1 and outs[0].finished and outs[0].error == too_long
    assert frontend.states == {} and backend.aborts() == []  # the backend already let go
