"""Q5：给 A、B 两个 uid 交错送入回复，怎样验证每个消费者只得到自己的结果，并且完成或取消后的
状态被清理？

答：不用 GPU，把 FrontendManager 接到一个假的 tokenizer worker（FakeBackend）上：它记录前台
发出的每条消息，并按测试指定的顺序注入 UserReply。按 A1 → B1 → B2 → A2 注入，检查 A 只拿到
A1A2、B 只拿到 B1B2；然后检查状态：
- 正常完成：`frontend.states` 为空，pending_bytes 归零，没有发 AbortMsg（后端已经自己结束了）；
- 取消（客户端断开时服务任务被 cancel）：状态同样被删除，并且给这个 uid 发了 AbortMsg，
  让 tokenizer worker 和 scheduler 也释放它；之后迟到的回复被丢弃，不会重新建立状态。
"""

from __future__ import annotations

import asyncio

import pytest

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.frontend import FrontendManager
from minisgl.testing.fakes import listening, make_frontend, settle

pytestmark = pytest.mark.q5


async def consume(frontend: FrontendManager, name: str, got: dict, send=None) -> None:
    """One request's consumer: what an HTTP handler does with its outputs. `send`, if
    given, is awaited after each output (writing it to the client)."""

    def make_msg(uid: int) -> TokenizeMsg:
        return TokenizeMsg(uid, SamplingParams(), text=name)

    async with frontend.request(make_msg) as state:
        got[name] = []
        async for out in frontend.wait_for_ack(state):
            got[name].append(out.text)
            if send is not None:
                await send()


def uids(backend) -> dict[str, int]:
    return {m.text: m.uid for m in backend.tokenized()}


def reply(uid: int, text: str, last: bool = False) -> UserReply:
    return UserReply(uid, text, finished=last, finish_reason="stop" if last else None)


async def test_a1_b1_b2_a2_each_consumer_gets_only_its_own_then_state_is_gone():
    frontend, backend = make_frontend()
    got: dict[str, list[str]] = {}
    async with listening(frontend):
        tasks = [asyncio.create_task(consume(frontend, name, got)) for name in "AB"]
        await settle()
        a, b = uids(backend)["A"], uids(backend)["B"]
        assert set(frontend.states) == {a, b}
        order = [reply(a, "A1"), reply(b, "B1"), reply(b, "B2", last=True), reply(a, "A2", True)]
        for msg in order:
            backend.inject(msg)
            await settle()
        await asyncio.gather(*tasks)
    assert got == {"A": ["A1", "A2"], "B": ["B1", "B2"]}
    assert frontend.states == {} and frontend.state() == {"requests": 0, "pending_bytes": 0}
    assert backend.aborts() == []  # both ended normally: nothing to abort


async def test_a_finishes_b_is_cancelled_only_b_is_aborted_and_nothing_is_left():
    frontend, backend = make_frontend()
    got: dict[str, list[str]] = {}
    async with listening(frontend):
        client_reads = asyncio.Event()  # B's client never reads: B's first send hangs
        tasks = {
            "A": asyncio.create_task(consume(frontend, "A", got)),
            "B": asyncio.create_task(consume(frontend, "B", got, client_reads.wait)),
        }
        await settle()
        a, b = uids(backend)["A"], uids(backend)["B"]
        backend.inject(reply(a, "A1"), reply(b, "B1"), reply(a, "A2", last=True))
        await settle()
        backend.inject(reply(b, "B2"))  # B is stuck sending B1: B2 waits in its buffer
        await settle()
        await tasks["A"]
        assert set(frontend.states) == {b} and frontend.state()["pending_bytes"] == 2

        tasks["B"].cancel()  # what a client disconnect does to the serving task
        with pytest.raises(asyncio.CancelledError):
            await tasks["B"]
        assert frontend.states == {} and frontend.state()["pending_bytes"] == 0
        assert backend.aborts() == [b]  # the workers are told to free B, and only B

        backend.inject(reply(b, "late"), reply(b, "", last=True))  # already in flight
        await settle()
    assert got == {"A": ["A1A2"], "B": ["B1"]}
    assert frontend.states == {}  # late replies are dropped, never recreate state
    assert backend.aborts() == [b]
