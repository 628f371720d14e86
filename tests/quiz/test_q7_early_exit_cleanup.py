"""Quiz question 7: early exit after `finished`, cancellation and errors: what cleans up.

Checks `request_scope(states, uid, make_msg, send_one)` (exercise q7) with minisgl's
listener and consumer loop over a FakeBackend:
- inside the block the uid's RequestState is in `states` and its TokenizeMsg was sent;
- `break` on the terminal output leaves no state and sends no AbortMsg; `break` before it
  leaves no state and sends exactly one, and replies that arrive later are dropped;
- a task cancelled at any await point (waiting for output, blocked in a send with output
  pending, woken but not yet run, blocked in a send after the terminal reply) has no state
  left the moment it is done, and sent one AbortMsg if and only if the terminal reply had
  not arrived;
- a task cancelled a second time while it leaves the scope (a server cancels a request
  whose client left, then cancels it again as it shuts down) still leaves no state and
  sends exactly one AbortMsg: the exit path must not await;
- an exception in the block propagates after the same cleanup; a message that cannot be
  made or sent leaves no state and nothing to abort; an error reply ends the request
  without an abort.

For contrast, the reference's design (`naive.RefStyleManager`, cleanup written after the
generator's loop): its maps after consumers that break right after `finished` and close
the generator, and after one that asks for one more item; and its cancel path
(`stream_with_cancellation`, `abort_user`): when the maps go and the AbortMsg is sent,
measured from the moment the client left, and where a late reply lands meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import pytest
from naive import ABORT_DELAY, RefStyleManager

from minisgl.core import SamplingParams
from minisgl.message import ErrorInfo, ErrorKind, TokenizeMsg, UserReply
from minisgl.server.frontend import FrontendManager
from minisgl.testing.fakes import FakeBackend, listening, make_frontend, settle, wait_until

pytestmark = pytest.mark.q7


LEFT_STATE = "作用域已经{how}离开了，这个 uid 的 RequestState 却还在 `states` 里"
ABORT_AFTER_END = (
    "终止回复已经到了，却还是发了 AbortMsg：worker 早已放开这个 uid"
    "（只有在终止回复之前离开时才中止）"
)
ONE_ABORT = (
    "在终止回复之前离开，必须为这个 uid 恰好发一次 AbortMsg，"
    "让 Tokenizer Worker 和 Scheduler 也释放它；实际发给了：{sent}"
)


def make_msg(uid: int) -> TokenizeMsg:
    return TokenizeMsg(uid, SamplingParams(), text="什么是 KV Cache？")


def replies(uid: int) -> list[UserReply]:
    return [UserReply(uid, "a"), UserReply(uid, "b", finished=True, finish_reason="stop")]


def scope(exercise, frontend: FrontendManager, make: Callable[[int], TokenizeMsg] = make_msg):
    """The exercise's scope for the next uid, over the frontend's states and channel."""
    uid = next(frontend.uid_counter)
    return exercise.request_scope(frontend.states, uid, make, frontend.send_one)


# ---------------------------------------------------------------- exercise q7


async def test_inside_the_block_the_state_exists_and_the_message_went_out(exercise):
    frontend, backend = make_frontend()
    async with scope(exercise, frontend) as state:
        assert frontend.states == {state.uid: state}, (
            "在作用域里，这个 uid 的 RequestState 必须在 `states` 里，监听协程要在那里找到它；"
            f"states 现在是 {frontend.states}"
        )
        assert [m.uid for m in backend.tokenized()] == [state.uid], (
            "在作用域里，TokenizeMsg 必须已经发出，而且恰好一次"
        )
        assert backend.tokenized()[0] == make_msg(state.uid), "发出的不是 make_msg 造的那条消息"
        backend.inject(*replies(state.uid))
        async with listening(frontend):
            outs = [out.text async for out in frontend.wait_for_ack(state)]
    assert outs == ["ab"], f"请求的输出是 {outs}"
    assert frontend.states == {}, LEFT_STATE.format(how="在终止回复之后")
    assert backend.aborts() == [], ABORT_AFTER_END


async def test_break_on_the_terminal_output_leaves_nothing_and_sends_no_abort(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        for _ in range(3):
            async with scope(exercise, frontend) as state:
                backend.inject(*replies(state.uid))
                async with aclosing(frontend.wait_for_ack(state)) as outputs:
                    async for out in outputs:
                        if out.finished:
                            break
    assert frontend.states == {}, LEFT_STATE.format(how="在终止输出处用 `break`")
    assert backend.aborts() == [], ABORT_AFTER_END


async def test_break_before_the_end_removes_state_and_aborts_once(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        async with scope(exercise, frontend) as state:
            backend.inject(UserReply(state.uid, "a"))
            async with aclosing(frontend.wait_for_ack(state)) as outputs:
                async for _ in outputs:
                    break  # the caller has seen enough
        assert frontend.states == {}, LEFT_STATE.format(how="在结束之前用 `break`")
        assert backend.aborts() == [state.uid], ONE_ABORT.format(sent=backend.aborts())
        backend.inject(*replies(state.uid))  # already on their way
        await settle()
    assert frontend.states == {}, "作用域离开之后，迟到的回复又重建了状态"
    assert backend.aborts() == [state.uid], ONE_ABORT.format(sent=backend.aborts())


POINTS = [
    "waiting_for_output",
    "in_a_send_with_output_pending",
    "woken_not_yet_run",
    "in_a_send_after_the_terminal_reply",
]


async def serving(exercise, frontend: FrontendManager) -> tuple[asyncio.Task, int]:
    """A task serving one request in the exercise's scope with minisgl's consumer loop,
    whose every send to the client blocks for ever; returns it and its uid once the
    request is in (the listener must be running)."""
    client_reads = asyncio.Event()  # never set: a send blocks for ever

    async def serve() -> None:
        async with scope(exercise, frontend) as state:
            async with aclosing(frontend.wait_for_ack(state)) as outputs:
                async for _ in outputs:
                    await client_reads.wait()  # writing the output to the client

    task = asyncio.create_task(serve())
    await settle()
    if task.done():
        task.result()  # it failed on entry: its error is the test's
    (uid,) = frontend.states
    return task, uid


@pytest.mark.parametrize("point", POINTS)
async def test_a_cancelled_request_is_cleaned_up_the_moment_its_task_is_done(exercise, point):
    frontend, backend = make_frontend()
    async with listening(frontend):
        task, uid = await serving(exercise, frontend)
        state = frontend.states[uid]
        if point == "in_a_send_with_output_pending":
            backend.inject(UserReply(uid, "a"))
            await settle()
            backend.inject(UserReply(uid, "b"))  # waits in the buffer
        elif point == "woken_not_yet_run":
            state.buffer.append(UserReply(uid, "a"))
            state.event.set()  # the consumer would run next; it is cancelled first
        elif point == "in_a_send_after_the_terminal_reply":
            backend.inject(UserReply(uid, "a"))
            await settle()
            backend.inject(UserReply(uid, "b", finished=True, finish_reason="stop"))
        await settle()
        terminal = state.terminal

        task.cancel()  # the client went away
        await asyncio.gather(task, return_exceptions=True)
        assert frontend.states == {}, (
            "任务已经结束，它的请求状态却还在：清理必须在离开作用域的路上"
            "（在 `finally` 里）当场运行，而不是过一会儿"
        )
        expected = [] if terminal else [uid]
        message = ABORT_AFTER_END if terminal else ONE_ABORT.format(sent=backend.aborts())
        assert backend.aborts() == expected, message

        backend.inject(UserReply(uid, "late"))  # a token already on its way
        await settle()
    assert frontend.states == {}, "作用域离开之后，迟到的回复又重建了状态"
    assert backend.aborts() == expected, message


async def test_cancelled_again_on_its_way_out_it_still_cleans_up_and_aborts_once(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        task, uid = await serving(exercise, frontend)
        backend.inject(UserReply(uid, "a"))
        await settle()  # blocked in a send, the request still going

        task.cancel()  # the client went away ...
        await asyncio.sleep(0)  # the task starts unwinding: up to its first await, if any
        task.cancel()  # ... and the server, shutting down, cancels it once more
        await asyncio.gather(task, return_exceptions=True)
        assert frontend.states == {}, (
            "在退出途中又被取消了一次，作用域留下了它的状态：它的退出路径在清理之前 await，"
            "第二次取消就在那里打断了它（send_one 是同步的，正是为了让退出路径不必 await）"
        )
        assert backend.aborts() == [uid], ONE_ABORT.format(sent=backend.aborts())


async def test_an_exception_in_the_block_propagates_after_cleanup_and_one_abort(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        with pytest.raises(UnicodeError, match="could not be written"):
            async with scope(exercise, frontend) as state:
                backend.inject(UserReply(state.uid, "a"))
                async for _ in frontend.wait_for_ack(state):
                    raise UnicodeError("the response could not be written")
    assert frontend.states == {}, LEFT_STATE.format(how="因为异常")
    assert backend.aborts() == [state.uid], ONE_ABORT.format(sent=backend.aborts())


@pytest.mark.parametrize("failing", ["make_msg", "send"])
async def test_a_message_that_never_went_out_leaves_no_state_and_nothing_to_abort(
    exercise, failing
):
    backend = FakeBackend()

    def send(msgs: list) -> None:
        if failing == "send":
            raise OverflowError("the message cannot be encoded")
        backend.send(msgs)

    def make(uid: int) -> TokenizeMsg:
        if failing == "make_msg":
            raise OverflowError("the message cannot be made")
        return make_msg(uid)

    frontend = FrontendManager(send, backend.recv)
    with pytest.raises(OverflowError, match="cannot be"):
        async with scope(exercise, frontend, make):
            pytest.fail("请求根本没有到达 worker，块却运行了")
    assert frontend.states == {}, "消息没有发出，它的 RequestState 却留在了 `states` 里"
    assert backend.sent == [], (
        f"什么都没到达 worker，所以没有什么要中止；实际发出了：{backend.sent}"
    )


async def test_an_error_reply_ends_the_request_without_abort(exercise):
    frontend, backend = make_frontend()
    too_long = ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "the prompt is too long")
    async with listening(frontend):
        async with scope(exercise, frontend) as state:
            backend.inject(UserReply(state.uid, finished=True, error=too_long))
            outs = [out async for out in frontend.wait_for_ack(state)]
    assert len(outs) == 1 and outs[0].finished and outs[0].error == too_long
    assert frontend.states == {}, LEFT_STATE.format(how="在错误回复之后")
    assert backend.aborts() == [], "错误回复就是这个请求的终止回复：后端已经放手，不该再发 AbortMsg"


# ---------------------------------------------------------------- the reference's design


def ref_manager() -> tuple[RefStyleManager, FakeBackend, asyncio.Task]:
    backend = FakeBackend()
    manager = RefStyleManager(backend.send, backend.recv)
    return manager, backend, asyncio.create_task(manager.listen())


async def test_reference_style_consumers_that_break_after_finished():
    manager, backend, listener = ref_manager()
    for _ in range(3):  # three requests, each consumer breaks right after `finished`
        uid = manager.new_user()
        backend.inject(*replies(uid))
        acks = manager.wait_for_ack(uid)
        async for ack in acks:
            if ack.finished:
                break
        await acks.aclose()  # closed explicitly, not left to the garbage collector
    listener.cancel()
    assert sorted(manager.ack_map) == sorted(manager.event_map) == [0, 1, 2]


async def test_reference_style_a_consumer_that_asks_for_one_more_item():
    manager, backend, listener = ref_manager()
    uid = manager.new_user()
    backend.inject(*replies(uid))
    texts = [ack.incremental_output async for ack in manager.wait_for_ack(uid)]  # no break
    listener.cancel()
    assert texts == ["a", "b"] and manager.ack_map == {} and manager.event_map == {}


@pytest.mark.parametrize("how", ["server_cancels_the_task", "disconnect_seen_before_a_chunk"])
async def test_reference_style_cancel_path(how):
    manager, backend, listener = ref_manager()
    uid = manager.new_user()
    gone = False

    async def is_disconnected() -> bool:
        return gone

    async def chunks() -> AsyncIterator[str]:
        async for ack in manager.wait_for_ack(uid):
            yield ack.incremental_output

    async def serve() -> None:
        async for _ in manager.stream_with_cancellation(chunks(), is_disconnected, uid):
            pass  # written to the client

    task = asyncio.create_task(serve())
    backend.inject(UserReply(uid, "a"))
    await settle()
    loop = asyncio.get_running_loop()
    left = loop.time()  # the client leaves
    if how == "server_cancels_the_task":
        task.cancel()
    else:
        gone = True
        backend.inject(UserReply(uid, "b"))  # the next chunk finds the client gone
    await asyncio.gather(task, return_exceptions=True)
    assert task.done()
    # the serving task is over, its request is not: its maps stay, no abort was sent
    assert uid in manager.ack_map and uid in manager.event_map and backend.aborts() == []
    backend.inject(UserReply(uid, "late"))  # the scheduler is still generating for it
    await settle()
    assert [r.incremental_output for r in manager.ack_map[uid]][-1] == "late"  # it lands

    await wait_until(lambda: backend.aborts() != [], timeout=1.0)
    assert loop.time() - left >= 0.99 * ABORT_DELAY  # a fixed wait, in another task
    assert backend.aborts() == [uid]
    assert uid not in manager.ack_map and uid not in manager.event_map
    listener.cancel()
