import asyncio
import json


async def outputs():  # 代替后端：增量文本一段段到来
    for text in ["Paris", " is the capital", " of France."]:
        await asyncio.sleep(0.01)  # 等下一段时，事件循环去运行别的协程
        yield text


async def app(scope, receive, send):  # ASGI 应用：服务器为每个 HTTP 请求调用一次
    text = "".join([t async for t in outputs()])  # 先收齐
    body = json.dumps({"content": text}, ensure_ascii=False).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})  # 再一次写回：响应结束


async def serve_once():  # 代替 uvicorn：调用一次 app，打印它交给服务器的每条消息
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        print(message)

    await app({"type": "http", "method": "POST", "path": "/"}, receive, send)


if __name__ == "__main__":
    asyncio.run(serve_once())
