import asyncio
import time


async def handler_blocking() -> str:
    time.sleep(1.0)  # 同步等待：整个事件循环停 1 秒
    return "done"


async def handler_yielding() -> str:
    await asyncio.sleep(1.0)  # 只有这个协程等待；循环去运行别人
    return "done"


async def main() -> None:
    for handler in (handler_blocking, handler_yielding):
        start = time.perf_counter()
        await asyncio.gather(*(handler() for _ in range(10)))  # 十个请求同时到达
        print(handler.__name__, f"{time.perf_counter() - start:.1f} s")


asyncio.run(main())
