"""错误设计（测验第 4 题）：先取走，让事件循环跑一下，再复位。

在 `await` 期间到达的回复置位了事件，紧接着的 `clear()` 又把这次置位抹掉：回复躺在
缓冲区里，再也没有什么会叫醒消费者。
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        await state.event.wait()
        output = state.buffer.take()
        await asyncio.sleep(0)
        state.event.clear()
        yield output
        if output.finished:
            return
