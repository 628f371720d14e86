"""The checks of the notebooks' exercises (练习): one per exercise cell.

Contract: an exercise is a code cell tagged `exercise` that defines one name (a function
or a class) with a stub body; the cell after it, tagged `check`, is one line,
`await checks.NAME(NAME)`, which runs that check's assertions against what the cell
defines and prints the verdict: "✓ 练习通过" or "✗ 还没通过：" and what is wrong, in the
chapter's words. A check never raises in the notebook (running the notebook top to bottom
goes on past an unfinished exercise); `await checks.NAME.verdict(answer)` returns the
failure (a string) or None, for tests/notebooks/test_notebook_exercises.py, which proves
each way: the committed stub fails, the reference solution passes.

The checks are self-contained: no model, no server, no timers; the exercise cells are too
(they import what they use), so a test can run a cell on its own.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import traceback
from collections.abc import Awaitable, Callable

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.testing.fakes import listening, make_frontend, settle

Check = Callable[[object], Awaitable[None] | None]


def exercise(check: Check):
    """Make `check` (assertions about the learner's answer) a notebook check."""

    async def verdict(answer) -> str | None:
        try:
            result = check(answer)
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, 10)
        except NotImplementedError:
            return "还没写：把练习单元格里的 `raise NotImplementedError` 换成你的代码，再运行一次。"
        except AssertionError as failed:
            return str(failed) or "一个断言没有通过：" + traceback.format_exc(limit=-1)
        except asyncio.TimeoutError:
            return "10 秒还没结束：有什么东西在永远等待。"
        except Exception as exc:  # the learner's code raised: say what and where
            return f"运行时出错：{type(exc).__name__}: {exc}"
        return None

    @functools.wraps(check)
    async def run(answer) -> None:
        problem = await verdict(answer)
        print("✓ 练习通过" if problem is None else f"✗ 还没通过：{problem}")

    run.verdict = verdict
    return run


def _msg(uid: int) -> TokenizeMsg:
    return TokenizeMsg(uid, SamplingParams(), text="什么是 KV Cache？")


# ---------------------------------------------------------------- 01 uid, buffer, event
@exercise
async def end_the_stuck_request(answer) -> None:
    """B never gets its terminal reply: `answer(task)` must end B's serving task so that
    nothing is left, and return only once it is over."""
    frontend, backend = make_frontend()

    async def consumer() -> None:
        async with frontend.request(_msg) as state:
            async for _ in frontend.wait_for_ack(state):
                pass

    async with listening(frontend):
        task = asyncio.create_task(consumer())
        await settle()
        (uid,) = frontend.states
        backend.inject(UserReply(uid, "B1", completion_tokens=1))  # never a terminal one
        await settle()
        await answer(task)
        assert task.done(), (
            "函数返回时 B 的任务还没结束：取消（cancel）只是请求取消，要 await 它，"
            "等它真正结束（serve_until_disconnect 也是这样等的）"
        )
        assert frontend.states == {}, f"B 的状态还在：frontend.states = {frontend.states}"
        assert backend.aborts() == [uid], (
            f"B 还没收到终止回复就离开了作用域，应该恰好发一次 AbortMsg；实际：{backend.aborts()}"
        )


# ---------------------------------------------------------------- 02 early exit
@exercise
async def finally_manager(answer) -> None:
    """`answer` is a RefStyleManager subclass whose wait_for_ack cleans up in a finally:
    consumers that break right after `finished` (and close the generator) leave nothing."""
    from naive import RefStyleManager

    from minisgl.testing.fakes import FakeBackend

    assert isinstance(answer, type) and issubclass(answer, RefStyleManager), (
        "FinallyManager 要是 RefStyleManager 的子类"
    )
    backend = FakeBackend()
    manager = answer(backend.send, backend.recv)
    async with listening(manager):
        for _ in range(20):
            uid = manager.new_user()
            backend.inject(
                UserReply(uid, "KV", completion_tokens=1),
                UserReply(uid, " Cache", True, "stop", completion_tokens=2),
            )
            replies = manager.wait_for_ack(uid)
            text = ""
            async for reply in replies:
                text += reply.incremental_output
                if reply.finished:
                    break
            await replies.aclose()  # what the event loop does to an abandoned generator
            assert text == "KV Cache", f"回复丢了或乱了：拿到的是 {text!r}"
    left = (len(manager.ack_map), len(manager.event_map))
    assert left == (0, 0), (
        f"20 个请求在 finished 处 break 之后，ack_map / event_map 还剩 {left} 个条目："
        "清理要写在 finally 里，生成器在 yield 处被关闭时只有 finally 会运行"
    )


# ---------------------------------------------------------------- 03 streaming
SSE_LINES = [
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":"KV"},"logprobs":null,'
    '"finish_reason":null}]}',
    "",
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"content":" Cache"},"logprobs":null,"finish_reason":null}]}',
    "",
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}',
    "",
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,'
    '"prompt_tokens_details":{"cached_tokens":0}}}',
    "",
    "data: [DONE]",
    "",
]
SSE_ERROR_LINES = [
    SSE_LINES[0],
    "",
    'data: {"error":{"message":"the scheduler process died","type":"server_error",'
    '"param":null,"code":"backend_unavailable"}}',
    "",
    "data: [DONE]",
    "",
]


@exercise
def sse_text(answer) -> None:
    """`answer(lines)`: the whole answer text of a chat stream's lines; an error event
    raises RuntimeError with the error's message."""
    text = answer(list(SSE_LINES))
    assert text == "KV Cache", (
        f"拼出来的是 {text!r}，应该是 'KV Cache'：只拼 delta.content；结束数据块的 delta 是空的，"
        "用量数据块的 choices 是空列表，[DONE] 不是 JSON"
    )
    try:
        answer(list(SSE_ERROR_LINES))
    except RuntimeError as err:
        assert "scheduler process died" in str(err), f"错误的说明应该是服务给的 message：{err}"
    else:
        raise AssertionError(
            '流里有一个 data: {"error": ...} 事件，这个请求失败了：应该抛出 RuntimeError，'
            "而不是把已经收到的半截文字当作回答"
        )


# ---------------------------------------------------------------- 04 cancellation
def _lifecycle(**changes) -> dict:
    state = {
        "frontend": {"requests": 0, "pending_bytes": 0},
        "tokenizer": {"decode_states": 0},
        "scheduler": {
            "pending": 0,
            "running": 0,
            "table_slots_used": 0,
            "kv_pages_used": 0,
            "kv_pages_total": 7000,
            "kv_pages_cached": 12,
            "prefix_cache_nodes": 12,
            "prefix_cache_query_tokens": 400,
            "prefix_cache_hit_tokens": 160,
            "grammar_matchers": 0,
        },
    }
    for path, value in changes.items():
        part, key = path.split("__")
        state[part][key] = value
    return state


@exercise
def all_released(answer) -> None:
    """`answer(state)`: whether a GET /debug/lifecycle answer shows every per-request
    count back at zero (pages kept by the prefix cache are no request's)."""
    assert answer(_lifecycle()) is True, (
        "空闲的服务（缓存里留着 12 页、KV 池 7000 页）应该算全部归零：kv_pages_total 是池子的"
        "大小，kv_pages_cached 和 prefix_cache_* 属于前缀缓存，不属于任何请求"
    )
    for path in [
        "frontend__requests",
        "frontend__pending_bytes",
        "tokenizer__decode_states",
        "scheduler__pending",
        "scheduler__running",
        "scheduler__table_slots_used",
        "scheduler__kv_pages_used",
        "scheduler__grammar_matchers",
    ]:
        part, key = path.split("__")
        assert answer(_lifecycle(**{path: 1})) is False, (
            f"{part}.{key} 是 1：还有一个请求的状态没有释放，不能算归零"
        )
    ranked = _lifecycle()
    ranked["scheduler"]["ranks"] = [
        dict(ranked["scheduler"]),
        {**ranked["scheduler"], "running": 1},
    ]
    assert answer(ranked) is False, (
        "张量并行时 scheduler.ranks 里是每个 rank 的计数：rank 1 还有一个在运行的序列"
    )


# ---------------------------------------------------------------- 05 slow client
@exercise
async def replies_that_fit(answer) -> None:
    """`answer(cap, reply_bytes)`: how many replies, each holding `reply_bytes` bytes of
    memory while it waits (server/memory.py's `text_bytes` of its text), can wait unread
    before a request with --max-pending-bytes `cap` is cut off."""
    from minisgl.server.memory import text_bytes

    for cap, chars in [(16 * 1024, 513), (1000, 100), (1000, 7), (4096, 4039)]:
        text = "x" * chars
        size = text_bytes(text)
        n = answer(cap, size)
        assert isinstance(n, int), f"要返回一个整数，不是 {n!r}"
        frontend, backend = make_frontend(max_pending_bytes=cap)
        async with listening(frontend):
            async with frontend.request(_msg) as state:
                backend.inject(*(UserReply(state.uid, text) for _ in range(n)))
                await settle()
                kept = backend.aborts() == []
                backend.inject(UserReply(state.uid, text))
                await settle()
                cut = backend.aborts() == [state.uid]
        assert kept, (
            f"上限 {cap} 字节、每条 {size} 字节：{n} 条没读的回复已经让请求被中止了，答多了"
        )
        assert cut, (
            f"上限 {cap} 字节、每条 {size} 字节：{n} 条之后再来一条也没有超过上限，答少了"
            "（恰好到上限不动作，超过才中止）"
        )


# ---------------------------------------------------------------- 06 prefix cache
@exercise
def cached_on_repeat(answer) -> None:
    """`answer(prompt_len, page_size)`: prompt tokens served from the cache when exactly
    the same prompt comes a second time (its pages are all in the tree)."""
    from minisgl.scheduler.radix import RadixCache

    for page_size in (4, 8, 16):
        for prompt_len in range(1, 4 * page_size + 2):
            tokens = list(range(100, 100 + prompt_len))
            tree = RadixCache(page_size)
            full = prompt_len // page_size
            tree.insert(tokens, list(range(full)))  # the first request's full pages
            # what CacheManager.match does for the second one: the last token stays to compute
            got = len(tree.match(tokens, (prompt_len - 1) // page_size)) * page_size
            mine = answer(prompt_len, page_size)
            assert mine == got, (
                f"{prompt_len} 个 token 的 prompt、每页 {page_size} 个 token：缓存给出 {got} 个，"
                f"你算的是 {mine}。只有整页能共享，而且 prompt 的最后一个 token 永远要算"
                "（这一步要从它的输出采样）"
            )


# ---------------------------------------------------------------- 07 timelines
def _timeline(*ends: tuple[str, str, float]) -> dict:
    events = [{"process": "api", "event": "received", "t": 0.0}]
    events += [{"process": p, "event": e, "t": t} for p, e, t in ends]
    return {"request_id": "x", "events": sorted(events, key=lambda e: e["t"])}


@exercise
def end_order(answer) -> None:
    """`answer(timeline)`: the processes that ended the request, in the order they did."""
    disconnect = _timeline(
        ("scheduler", "queued", 0.01),
        ("api", "aborted", 0.50),
        ("tokenizer", "aborted", 0.503),
        ("scheduler", "aborted", 0.52),
    )
    assert answer(disconnect) == ["api", "tokenizer", "scheduler"], (
        "客户端断开：API Server 最先发现，Tokenizer Worker 收到 AbortMsg 后结束，Scheduler 最后"
        f"（算完手上那一步）；你给的是 {answer(disconnect)}"
    )
    too_long = _timeline(
        ("scheduler", "queued", 0.01),
        ("scheduler", "error", 0.011),
        ("tokenizer", "error", 0.012),
        ("api", "error", 0.013),
    )
    assert answer(too_long) == ["scheduler", "tokenizer", "api"], (
        "prompt 过长：Scheduler 在入队时发现并最先结束，错误沿原路回到 API Server；"
        f"你给的是 {answer(too_long)}"
    )
    finished = _timeline(
        ("scheduler", "first_token", 0.2),
        ("scheduler", "finished", 1.0),
        ("tokenizer", "finished", 1.001),
        ("api", "finished", 1.002),
    )
    assert answer(finished) == ["scheduler", "tokenizer", "api"], (
        "只数每个进程的结束事件（finished、aborted、error），不是它的第一个事件"
    )
