"""练习 q7（测验第 7 题）：无论从哪里离开都会清理的请求作用域。

任务：写 `request_scope`，一个异步上下文管理器，这样使用：
`async with request_scope(states, uid, make_msg, send_one) as state:`。
- 进入时在 `states` 里为这个 uid 创建 `RequestState(uid)`
  （minisgl/server/frontend.py），监听协程在那里找到它；然后用 `send_one` 发出
  `make_msg(uid)`。如果造消息或发消息失败，错误向外传播，不留下状态；什么都没有
  到达 worker，所以也没有什么要中止。
- 离开这个块时删除状态，无论从哪条路离开：请求结束、`break`、`return`、异常（异常
  必须向外传播），或者任务被取消（客户端断开了）。要当场删除，而不是过一会儿。
- 终止回复还没到就离开时（终止回复到达时，监听协程会置位 `state.terminal`），还要
  恰好发一次 `AbortMsg(uid)`，让 Tokenizer Worker 和 Scheduler 也释放这个 uid。
  终止回复到了之后，worker 已经放手：这时不要中止。

提示：
- 生成器在 `yield` 处被关闭时、被取消的任务逐层退出时，哪些语句还会运行（第 6.1 节）？
- `send_one` 是同步的：它可以在 `await` 会被打断的地方运行。
- 桩代码已经是一个 `asynccontextmanager`：它唯一的 `yield` 之前的代码是入口，之后的
  代码是出口。哪些离开方式会走到那段代码，又是怎样走到的？
- 第 6.2 节展示了参考实现的取消路径；第 5 节是 minisgl 的作用域：先写你自己的，
  再去读它。

检查：pytest tests/quiz --learner -m q7
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import RequestState

TODO = (
    "练习 q7：编辑 tests/quiz/exercises/q7_request_scope.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q7"
)


@asynccontextmanager
async def request_scope(
    states: dict[int, RequestState],
    uid: int,
    make_msg: Callable[[int], TokenizeMsg],
    send_one: Callable[[TokenizerMsg], None],
) -> AsyncIterator[RequestState]:
    raise NotImplementedError(TODO)
    yield  # 永远执行不到：它只是让这个桩成为异步生成器，你写的也会是
