"""Exercise q6 (quiz question 6): one streamed chat completion, byte by byte.

Task: write `stream_chat(outputs, send, model)`: answer one `stream: true` chat request
(one choice) through the ASGI `send` callable, from the request's coalesced `Output`s
(minisgl/server/buffer.py; `output.text`, `.finish_reason`, `.finished`, `.error`).
- A successful stream is a 200 with `content-type: text/event-stream`, then one
  `{"type": "http.response.body", "body": ..., "more_body": ...}` message per output.
- Every event is `data: ` + one line of JSON + a blank line. Every chunk is an OpenAI
  `chat.completion.chunk` (id, object, created, model, choices), all with one id that
  starts with `chatcmpl-`. A choice is `{"index", "delta", "logprobs", "finish_reason"}`.
- The first chunk announces the role "assistant"; text goes in the delta's `content`,
  only the new part. When the request ends, a chunk with an empty delta carries the
  finish_reason, and `data: [DONE]` follows; both go out in the last send, which ends the
  response (`more_body: False`).
- Errors (`output.error`) can come with the first output or with a later one. What can
  the client still be told in each case, and how? `to_http(error, "messages")`
  (minisgl/server/errors.py) gives an error answer's status and JSON body. The tests
  expect what chapter §4.3 and §4.5 describe.

Hints:
- When may the status line go out? What can you still say after it did?
- Test your chunks with the `openai` package's `ChatCompletionChunk.model_validate`.
- Chapter §4.3 and §4.4; minisgl's `StreamResponse.serve` and `ChatFormat.chunks` are the
  full versions (several choices, logprobs, usage): write yours before you read them.

Check: pytest tests/quiz --learner -m q6
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from minisgl.server.buffer import Output

Send = Callable[[dict[str, Any]], Awaitable[None]]

TODO = (
    "exercise q6: edit tests/quiz/exercises/q6_sse_stream.py (its docstring says what to "
    "do), then check with: pytest tests/quiz --learner -m q6"
)


async def stream_chat(outputs: AsyncIterator[Output], send: Send, model: str) -> None:
    raise NotImplementedError(TODO)
