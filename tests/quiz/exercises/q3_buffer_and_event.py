"""练习 q3（测验第 3 题）：每个请求一个回复缓冲区和一个唤醒事件。

任务：写 `ReplyInbox`，监听协程为一个 uid 保存的东西。它有一个公开的
`event: asyncio.Event`，消费者等在它上面。
- `deliver(reply)` 是监听协程这一侧：存下回复的文本，以及它是不是这个请求的终止
  回复（`reply.finished`）；消费者有新东西可取时叫醒它：文本、`finish_reason`，
  或者结束。三样都没带的回复（只更新了 token 数）不能叫醒任何人。
- `take()` 是消费者这一侧：返回一个 `Taken`，其中是上次取走之后送来的全部文本，
  按到达顺序拼接，以及终止回复是否已经送到；取完之后，没有任何待取的东西。

提示：
- 事件只是一个标志：没人来看之前的五次 `set()` 只等于一次。这期间，五条回复的文本在哪里等着？
- 反过来，没有事件的话，正在等的消费者怎样得知有东西到了？
- `UserReply` 在 minisgl/message/frontend.py 里；第 3.1 节讨论了这两半。

检查：pytest tests/quiz --learner -m q3
"""

from __future__ import annotations

from typing import NamedTuple

from minisgl.message import UserReply

TODO = (
    "练习 q3：编辑 tests/quiz/exercises/q3_buffer_and_event.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q3"
)


class Taken(NamedTuple):
    text: str  # 上次取走之后送来的全部文本，按顺序
    finished: bool  # 这个请求的终止回复已经送到


class ReplyInbox:
    def __init__(self) -> None:
        raise NotImplementedError(TODO)

    def deliver(self, reply: UserReply) -> None:
        raise NotImplementedError(TODO)

    def take(self) -> Taken:
        raise NotImplementedError(TODO)
