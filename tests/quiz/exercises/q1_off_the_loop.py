"""练习 q1（测验第 1 题）：阻塞调用不能卡住事件循环。

任务：`generate(prompt)` 是一个普通的同步函数，会像模型计算那样占住它所在的线程
一段时间。写 `generate_off_the_loop`：`async def` 路由调用它，拿回
`generate(prompt)` 的结果，而事件循环在这期间照常服务其他所有连接。`generate`
抛出的异常要传到调用方。

提示：
- 先试最直接的写法：调用 `generate(prompt)` 并返回结果。测试会告诉你这期间其他连接看到了什么。
- 同一个事件循环上，另一个协程什么时候才能运行？有什么可以 await 的东西，
  让你等着的同时，`generate` 在事件循环自己的线程之外运行？
- asyncio 的文档里有一节讲怎样在线程里运行普通函数。
- minisgl 自己的路由根本不调用计算；第 2.2 节讲了计算在哪里运行。

检查：pytest tests/quiz --learner -m q1
"""

from __future__ import annotations

from collections.abc import Callable

TODO = (
    "练习 q1：编辑 tests/quiz/exercises/q1_off_the_loop.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q1"
)


async def generate_off_the_loop(generate: Callable[[str], str], prompt: str) -> str:
    raise NotImplementedError(TODO)
