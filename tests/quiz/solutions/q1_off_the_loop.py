"""练习 q1 的参考实现：异步路由里的阻塞调用，放到事件循环之外。

约定：`await generate_off_the_loop(generate, prompt)` 返回 `generate(prompt)`。同步的
`generate` 运行期间（它像模型计算那样占住自己的线程），事件循环照常运行其他所有协程，
所以其他连接在这期间照样得到服务。`generate` 抛出的异常传到调用方。
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


# --8<-- [start:off_the_loop]
async def generate_off_the_loop(generate: Callable[[str], str], prompt: str) -> str:
    # 事件循环的线程只做 await：计算在一个工作线程里运行，await 把事件循环交还给
    # 其他所有协程，直到结果出来。minisgl 走得更远：分词和前向计算在别的进程里运行，
    # 所以它的路由只需要 await。
    return await asyncio.to_thread(generate, prompt)


# --8<-- [end:off_the_loop]
