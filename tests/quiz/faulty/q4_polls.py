"""错误设计（测验第 4 题）：每 10 ms 轮询一次的消费者。

它在定时器上睡一会儿，然后看一眼：比空转省 CPU，但每秒白白醒来一百次，而且一条回复
最多要等 10 ms 才有人来取。
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        await asyncio.sleep(0.01)
        if not state.event.is_set():
            continue
        state.event.clear()
        output = state.buffer.take()
        yield output
        if output.finished:
            return
