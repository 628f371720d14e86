"""Reference solution of exercise q2: where the fields of a chat request go.

Contract:
- `tokenize_msg(req, uid, tools)` is the TokenizeMsg that /v1/chat/completions sends to
  the tokenizer worker for `req` under `uid`: the chat messages as chat-template input
  (`{"role", "content"}`, text parts joined, "developer" as "system"), the tools the
  template shows the model (none for tool_choice "none"), and every sampling parameter in
  `SamplingParams` (`max_tokens` or `max_completion_tokens` as `max_tokens`; a forced tool
  call as the grammar that `tools`, the request's tool-call format, writes), and how the
  chat template renders the messages (`add_generation_prompt`, `continue_final_message`,
  its extra variables).
- `frontend_only_fields()` names the request fields that never reach the workers: changing
  one of them changes no message the API server sends.
"""

from __future__ import annotations

from minisgl.message import TokenizeMsg
from minisgl.server.chat import ChatCompletionRequest


def tokenize_msg(req: ChatCompletionRequest, uid: int, tools) -> TokenizeMsg:
    messages = [m.as_template_input() for m in req.messages]  # the chat template's input
    return TokenizeMsg(
        uid,
        req.sampling_params(tools),
        messages=messages,
        tools=req.template_tools(),
        # how the template renders them (with reasoning_effort among its variables)
        add_generation_prompt=req.generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.template_kwargs(),
    )


def frontend_only_fields() -> set[str]:
    return {
        "model",  # compared with the served model's name: a mismatch is a 404
        "stream",  # picks StreamResponse or FullResponse
        "stream_options",  # include_usage: one more chunk at the end of the stream
        "user",  # logged with the request
        "response_format",  # {"type": "text"} asks for nothing (a schema would constrain)
        # OpenAI's fields for what a hosted service stores, bills, caches or routes by,
        # accepted so that clients that send them work, and ignored
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "verbosity",
        "prediction",
        "modalities",  # ["text"]: what is generated anyway (audio is refused)
        "audio",  # only null is accepted
    }
