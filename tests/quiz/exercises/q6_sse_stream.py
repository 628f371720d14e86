"""练习 q6（测验第 6 题）：一个流式聊天补全，逐字节地看。

任务：写 `stream_chat(outputs, send, model)`：用 ASGI 的 `send` 可调用对象回答一个
`stream: true` 的聊天请求（一个选择），数据来自这个请求合并后的 `Output` 序列
（minisgl/server/buffer.py；`output.text`、`.finish_reason`、`.finished`、`.error`）。
- 成功的流是一个 200，带 `content-type: text/event-stream`，然后每个输出一条
  `{"type": "http.response.body", "body": ..., "more_body": ...}` 消息。
- 每个事件都是 `data: ` 加一行 JSON 加一个空行。每个数据块都是 OpenAI 的
  `chat.completion.chunk`（id、object、created、model、choices），共用一个以
  `chatcmpl-` 开头的 id。一个选择是 `{"index", "delta", "logprobs", "finish_reason"}`。
- 第一个数据块宣布角色 "assistant"；文本放在 delta 的 `content` 里，只放新增的部分。
  请求结束时，一个 delta 为空的数据块带上 finish_reason，后面跟着 `data: [DONE]`；
  两者都在最后一次 send 里发出，这次 send 结束响应（`more_body: False`）。
- 错误（`output.error`）可能随第一个输出到来，也可能随后面的某个输出到来。两种情况
  下，还能告诉客户端什么、怎样告诉？`to_http(error, "messages")`
  （minisgl/server/errors.py）给出错误回答的状态码和 JSON 体。测试要求的就是
  第 4.3 节和第 4.5 节所讲的行为。

提示：
- 状态行什么时候可以发出？发出之后，你还能说什么？
- 用 `openai` 包的 `ChatCompletionChunk.model_validate` 检验你的数据块。
- 见第 4.3 节和第 4.4 节；minisgl 的 `StreamResponse.serve` 和 `ChatFormat.chunks` 是
  完整版本（多个选择、logprobs、usage）：先写你自己的，再去读它们。

检查：pytest tests/quiz --learner -m q6
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from minisgl.server.buffer import Output

Send = Callable[[dict[str, Any]], Awaitable[None]]

TODO = (
    "练习 q6：编辑 tests/quiz/exercises/q6_sse_stream.py（文件开头的文档字符串写着"
    "要做什么），然后这样检查：pytest tests/quiz --learner -m q6"
)


async def stream_chat(outputs: AsyncIterator[Output], send: Send, model: str) -> None:
    raise NotImplementedError(TODO)
