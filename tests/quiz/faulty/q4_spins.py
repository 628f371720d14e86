"""错误设计（测验第 4 题）：在事件循环上空转的消费者。

它从不等在事件上：看一眼缓冲区，用 `asyncio.sleep(0)` 让一下事件循环，再看一眼，
什么都没到时每秒上千次。什么也不会丢，但一百个闲着的请求就让事件循环白白忙个不停。
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        while not state.event.is_set():
            await asyncio.sleep(0)
        state.event.clear()
        output = state.buffer.take()
        yield output
        if output.finished:
            return
