"""Reference solution of exercise q2: where the fields of a chat request go.

Contract:
- `tokenize_msg(req, uid)` is the TokenizeMsg that /v1/chat/completions sends to the
  tokenizer worker for `req` under `uid`: the chat messages as chat-template input
  (`{"role", "content"}`, text parts joined, "developer" as "system"), the tools the
  template shows the model (none for tool_choice "none"), and every sampling parameter in
  `SamplingParams` (`max_tokens` or `max_completion_tokens` as `max_tokens`; a forced tool
  call as the grammar that forces it).
- `frontend_only_fields()` names the request fields that never reach the workers: changing
  one of them changes no message the API server sends.
"""

from __future__ import annotations

from minisgl.message import TokenizeMsg
from minisgl.server.protocol import ChatCompletionRequest


def tokenize_msg(req: ChatCompletionRequest, uid: int) -> TokenizeMsg:
    messages = [m.as_template_input() for m in req.messages]  # the chat template's input
    return TokenizeMsg(uid, req.sampling_params(), messages=messages, tools=req.template_tools())


def frontend_only_fields() -> set[str]:
    return {
        "model",  # compared with the served model's name: a mismatch is a 404
        "stream",  # picks StreamResponse or FullResponse
        "stream_options",  # include_usage: one more chunk at the end of the stream
        "user",  # logged with the request
        "response_format",  # {"type": "text"} asks for nothing (a schema would constrain)
    }
