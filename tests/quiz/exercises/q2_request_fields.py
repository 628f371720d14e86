"""Exercise q2 (quiz question 2): where messages, max_tokens and stream go.

Task: write the two functions below for /v1/chat/completions.
- `tokenize_msg(req, uid, tools)`: the TokenizeMsg the API server sends to the tokenizer
  worker for the parsed request `req` under `uid`. The tests compare it with the message
  the real route (`v1_chat_completions` in minisgl/server/chat.py) sends, for many
  requests. `tools` is the request's tool-call format (None without tools), as the route
  gets it from the server's output parsers: it writes the grammar of a forced tool call.
- `frontend_only_fields()`: the names of the `ChatCompletionRequest` fields that never
  reach the workers, i.e. changing one of them changes no message at all. The tests vary
  each field of the request model in turn to check your set.

Hints:
- The tokenizer worker applies the model's chat template; what does a chat template take
  as input? `ChatMessage` (minisgl/server/conversation.py) knows how to become it, and the
  request knows which of its tools the template shows the model.
- The request model already knows how to build its `SamplingParams`: find that method, and
  read what it does with `max_tokens` and `max_completion_tokens`.
- `TokenizeMsg` (minisgl/message/tokenizer.py) has no field for a stream: so where does
  `stream` act? And the other fields that are not sampling parameters?
- The table in chapter §2.1 lists where several fields go; it does not list them all.

Check: pytest tests/quiz --learner -m q2
"""

from __future__ import annotations

from minisgl.message import TokenizeMsg
from minisgl.server.chat import ChatCompletionRequest

TODO = (
    "exercise q2: edit tests/quiz/exercises/q2_request_fields.py (its docstring says what "
    "to do), then check with: pytest tests/quiz --learner -m q2"
)


def tokenize_msg(req: ChatCompletionRequest, uid: int, tools) -> TokenizeMsg:
    raise NotImplementedError(TODO)


def frontend_only_fields() -> set[str]:
    raise NotImplementedError(TODO)
