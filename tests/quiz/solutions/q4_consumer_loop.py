"""练习 q4 的参考实现：一个请求的消费循环。

约定：`wait_for_ack(state)` 依次交出这个请求的输出，直到终止输出，然后结束。每个输出
是一次唤醒时待取的全部内容（`state.buffer.take()`），所以两次唤醒之间到达的任意多条
回复一起出来。唤醒永远不会丢：消费者不在时（两个输出之间）到达的回复会再次叫醒它；
没有待取的东西时，循环真的在等。
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


# --8<-- [start:consumer_loop]
async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        await state.event.wait()
        # 先复位，再取走，中间没有 await：监听协程插不进这两行之间，所以每条回复
        # 要么在这次取走的内容里，要么在取走之后重新置位事件
        state.event.clear()
        output = state.buffer.take()
        yield output
        if output.finished:
            return


# --8<-- [end:consumer_loop]
