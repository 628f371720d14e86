"""`POST /v1/responses`, the output side: chat output as Responses output items and events.

Contract: `ResponsesFormat(model, request, tools)` is made per HTTP request and is the
response's format object, like ChatFormat (whose tool-call parsing it reuses: the same
text gives the same calls on both endpoints). It turns the frontend's coalesced outputs
into
- `chunks(output)`: the stream's events, each `event: <type>` and `data: {...}` with a
  `sequence_number` counting from 0, in OpenAI's order: `response.created` and
  `response.in_progress` first; for text, `response.output_item.added` (a message),
  `response.content_part.added`, `response.output_text.delta`..., then
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`;
  for each tool call, `response.output_item.added` (a function_call),
  `response.function_call_arguments.delta`, `.done` and `response.output_item.done`;
  last `response.completed`, or `response.incomplete` (max_output_tokens reached) with the
  whole response, or `response.failed` with its error when the request failed after the
  stream began. Nothing follows the last event (no `[DONE]`);
- `body(...)`: the whole `response` object, built by the same steps as the stream, so a
  streamed and a whole answer never differ;
- `error(error_info)`: the HTTP error answer before the first byte, naming fields as the
  Responses API does (the prompt is `input`, max_tokens is `max_output_tokens`).
The shapes validate as the `openai` client's `Response` and `ResponseStreamEvent` types.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

import msgspec

from minisgl.message import ErrorInfo, TokenInfo

from ..buffer import ChoiceOutput, Output
from ..chat import ChatFormat
from ..choice_text import ToolCalls
from ..errors import HttpError, to_http
from .request import CHAT_NAMES, ResponsesRequest

_json = msgspec.json.Encoder()


def _event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat(ChatFormat):
    prompt_param = "input"

    def __init__(self, model: str, request: ResponsesRequest, tools: ToolCalls | None) -> None:
        super().__init__(model, 1, tools)
        self.id = _id("resp")
        self.created = time.time()
        self.request = request
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # the response's items so far
        self._message: dict[str, Any] | None = None  # the message item being written
        self._text_so_far = ""  # its text
        self._finish_reason_of: str | None = None  # the choice's finish_reason, once it ended
        self._opened = False

    # ------------------------------------------------------------ the format interface
    def error(self, error: ErrorInfo) -> HttpError:
        """The chat path's answer, naming the field as this API calls it."""
        answer = super().error(error)
        return replace(answer, param=CHAT_NAMES.get(answer.param, answer.param))

    def chunks(self, output: Output) -> bytes:
        self.reasoning_open = self.reasoning_open or output.reasoning_open
        events: list[dict[str, Any]] = []
        if not self._opened:
            self._opened = True
            events.append(self._lifecycle("response.created", self._response("in_progress")))
            events.append(self._lifecycle("response.in_progress", self._response("in_progress")))
        for choice in output.choices:
            events += self._feed(choice)
        if output.finished:
            if output.error is not None:
                events.append(self._failed(output.error))
            else:
                events += self._finish(output)
        return b"".join(_event(e) for e in events)

    def closing(self, output: Output, include_usage: bool) -> bytes:
        return b""  # the last event (completed, incomplete or failed) ends the stream

    def body(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        logprobs: list[list[TokenInfo]] | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int | None = 0,
        reasoning_open: bool = False,
    ) -> dict[str, Any]:
        self.reasoning_open = reasoning_open  # (its reasoning is read out, not sent)
        choice = ChoiceOutput(0, texts[0], finish_reasons[0], [])
        self._feed(choice)
        out = Output([choice], prompt_tokens, completion_tokens, True, None, cached_tokens)
        return self._finish(out)[-1]["response"]

    # ------------------------------------------------------------ steps
    def _emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _lifecycle(self, type_: str, response: dict[str, Any]) -> dict[str, Any]:
        return self._emit(type_, response=response)

    def _feed(self, choice: ChoiceOutput) -> list[dict[str, Any]]:
        """Events for the choice's new text: message text, then any calls it completed."""
        self._finish_reason_of = choice.finish_reason or self._finish_reason_of
        content, calls = self._parse(choice)
        events = self._text(content) if content else []
        for call in calls:
            events += self._close_message("completed")
            events += self._call(call)
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": _id("msg"), "type": "message", "role": "assistant"}
        self._message = {**item, "status": "in_progress", "content": []}
        self._text_so_far = ""
        self._output.append(self._message)
        added = {**item, "status": "in_progress", "content": []}
        return [
            self._item_event("response.output_item.added", added),
            self._emit("response.content_part.added", **self._where(), part=_output_text("")),
        ]

    def _text(self, piece: str) -> list[dict[str, Any]]:
        events = self._open_message() if self._message is None else []
        self._text_so_far += piece
        delta = self._emit("response.output_text.delta", **self._where(), delta=piece, logprobs=[])
        return events + [delta]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        text = self._text_so_far
        message["content"] = [_output_text(text)]
        message["status"] = status
        index = self._output.index(message)
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self._emit("response.output_text.done", **where, text=text, logprobs=[]),
            self._emit("response.content_part.done", **where, part=_output_text(text)),
            self._emit("response.output_item.done", output_index=index, item=dict(message)),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call["function"]
        item = {
            "id": _id("fc"),
            "type": "function_call",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": "",
            "status": "in_progress",
        }
        index = len(self._output)
        self._output.append(item)
        where = {"item_id": item["id"], "output_index": index}
        events = [self._item_event("response.output_item.added", dict(item), index)]
        arguments = function["arguments"]
        events.append(
            self._emit("response.function_call_arguments.delta", **where, delta=arguments)
        )
        events.append(
            self._emit(
                "response.function_call_arguments.done",
                **where,
                arguments=arguments,
                name=item["name"],
            )
        )
        item.update(arguments=arguments, status="completed")
        events.append(self._item_event("response.output_item.done", dict(item), index))
        return events

    def _finish(self, output: Output) -> list[dict[str, Any]]:
        incomplete = self._finish_reason_of == "length"
        status = "incomplete" if incomplete else "completed"
        # nothing was said: still one (empty) message
        events = self._open_message() if not self._output else []
        events += self._close_message(status)
        response = self._response(status, output)
        if incomplete:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        events.append(self._lifecycle(f"response.{status}", response))
        return events

    def _failed(self, error: ErrorInfo) -> dict[str, Any]:
        answer = to_http(error, self.prompt_param)
        code = "invalid_prompt" if answer.status < 500 else "server_error"
        response = self._response("failed")
        response["error"] = {"code": code, "message": error.message}
        return self._lifecycle("response.failed", response)

    # ------------------------------------------------------------ shapes
    def _where(self) -> dict[str, Any]:
        message = self._message
        return {
            "item_id": message["id"],
            "output_index": self._output.index(message),
            "content_index": 0,
        }

    def _item_event(self, type_: str, item: dict[str, Any], index: int | None = None) -> dict:
        index = self._output.index(self._message) if index is None else index
        return self._emit(type_, output_index=index, item=item)

    def _response(self, status: str, output: Output | None = None) -> dict[str, Any]:
        req = self.request
        text_format = req.text.format if req.text and req.text.format else None
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [dict(item) for item in self._output] if status != "in_progress" else [],
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None,
                "summary": None,
            },
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": text_format.as_output() if text_format else {"type": "text"}},
            "tool_choice": _tool_choice(req),
            "tools": [t.as_output() for t in req.tools or []],
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
        }
        if output is not None:
            body["completed_at"] = time.time()
            body["usage"] = {
                "input_tokens": output.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": output.cached_tokens or 0,  # None: not told
                    "cache_write_tokens": 0,
                },
                "output_tokens": output.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": output.prompt_tokens + output.completion_tokens,
            }
        return body


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return {"type": "function", "name": choice.name}
