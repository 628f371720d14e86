"""练习 q4（测验第 4 题）：一次唤醒也不丢的消费循环。

任务：写 `wait_for_ack(state)`，一个异步生成器，作用在一个请求的 `RequestState`
（minisgl/server/frontend.py）上：它的 `buffer`（一个 `ReplyBuffer`）存着待取的输出，
每当缓冲区有了新东西，监听协程就置位它的 `event`。依次交出这个请求的输出
（`state.buffer.take()` 把全部待取的内容作为一个 `Output` 返回），直到终止输出
（`output.finished`），然后结束。什么都不能丢：调用方还在处理上一个输出时（比如
正写给一个慢客户端）到达的回复，必须再次叫醒你；没有待取的东西时，循环必须真的
等着，而不是空转。

提示：
- 四步：等待、复位、取走、交出。按什么顺序，回复会落在两步之间、置位事件，而这次 `set()` 又被抹掉？
- 在单线程的事件循环里，只有你停在某个 `await` 上时，监听协程才会运行。
- 第 3.2 节完整地走了一遍；测验第 4 题问的是顺序变了会怎样。

检查：pytest tests/quiz --learner -m q4
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState

TODO = (
    "练习 q4：编辑 tests/quiz/exercises/q4_consumer_loop.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q4"
)


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    raise NotImplementedError(TODO)
    yield  # 永远执行不到：它只是让这个桩成为异步生成器，你写的也会是
