"""错误设计（测验第 1 题）：直接在协程里调用同步函数。

光有 `async def` 并不会把任何东西挪出事件循环：`generate` 运行期间，别的协程一步也
走不了，其他每个连接都在等。
"""

from __future__ import annotations

from collections.abc import Callable


async def generate_off_the_loop(generate: Callable[[str], str], prompt: str) -> str:
    return generate(prompt)
