"""练习 q5（测验第 5 题）：把交错到达的回复送到各自的请求。

任务：写 `route(states, replies)`，监听协程处理 Tokenizer Worker 发来的一批
`UserReply` 的那部分工作。`states` 把每个在途请求的 uid 映射到它的 `RequestState`
（minisgl/server/frontend.py）。不同请求的回复交错到达，例如 A1 B1 B2 A2：每条
只能进入它自己请求的缓冲区，保持顺序，并在缓冲区表示有新东西时叫醒那个请求的
消费者。终止回复（`finished`）把状态标记为 `terminal`，请求作用域据此知道不需要
AbortMsg。uid 没有状态的回复，或者请求已经结束之后的回复，是迟到的回复：丢掉它，
绝不为它创建状态。

提示：
- `ReplyBuffer.append`（minisgl/server/buffer.py）返回消费者是否有新东西；只更新计数的回复不叫醒谁。
- 迟到的回复属于哪些请求？如果监听协程为它腾出位置，哪个组件会泄漏？
- 第 3.3 节和第 3.4 节讲了监听协程和 A1 B1 B2 A2 的情形；测试会把你的函数放在
  真实的 Tokenizer Worker 和一个假的 Scheduler 之间运行。

检查：pytest tests/quiz --learner -m q5
"""

from __future__ import annotations

from minisgl.message import UserReply
from minisgl.server.frontend import RequestState

TODO = (
    "练习 q5：编辑 tests/quiz/exercises/q5_route_by_uid.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q5"
)


def route(states: dict[int, RequestState], replies: list[UserReply]) -> None:
    raise NotImplementedError(TODO)
