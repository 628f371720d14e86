"""Helpers for the OpenAI-protocol tests (test_protocol_*.py): requests made with the
official `openai` client, whose raw JSON (and raw SSE events) is validated strictly
against the client's own types before the test looks at it.

`ask(client, endpoint, stream, **params)` returns an `Answer` gathered the same way for
both endpoints, streamed or not: the text, finish_reason and logprobs of every choice
index, and the usage. Streamed, it also checks the wire: every event one `data:` line, one
`[DONE]` at the very end, every chunk of one id; a usage chunk (empty `choices`) only as
the last chunk before `[DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import openai
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minisgl.testing.sse import chunks_of_lines

LONG = 1500  # max_tokens of a generation that would run for a second or more


class _CompletionChunkChoice(CompletionChoice):
    # OpenAI streams legacy completions as `text_completion` objects whose choices carry
    # `finish_reason: null` until the last; the client's `CompletionChoice` type (written
    # for whole responses) requires a reason, so chunks are validated with this one field
    # relaxed and every other field as strictly as `Completion`.
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class CompletionChunk(Completion):
    choices: list[_CompletionChunkChoice]


@dataclass
class Answer:
    text: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    logprobs: dict[int, list[Any]] = field(default_factory=dict)  # per token, in order
    usage: CompletionUsage | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)  # streamed: raw chunk bodies

    @property
    def indices(self) -> list[int]:
        return sorted(self.text)

    def only(self) -> str:
        assert self.indices == [0], self.indices
        return self.text[0]


def _chat_resource(client: openai.OpenAI, endpoint: str):
    return client.chat.completions if endpoint == "chat" else client.completions


def ask(client: openai.OpenAI, endpoint: str, stream: bool, **params: Any) -> Answer:
    """One request through the official client; `endpoint` is "chat" or "completions".
    Parameters the client does not know go in `extra_body` by the caller."""
    resource = _chat_resource(client, endpoint)
    if not stream:
        raw = resource.with_raw_response.create(**params)
        assert raw.status_code == 200, raw.text
        assert raw.headers["content-type"].startswith("application/json")
        body = raw.http_response.json()
        parsed = raw.parse()  # what a client program sees
        return _whole(endpoint, body, parsed)
    with resource.with_streaming_response.create(stream=True, **params) as raw:
        assert raw.status_code == 200, raw.read()
        assert raw.headers["content-type"].startswith("text/event-stream")
        lines = list(raw.iter_lines())
    return _streamed(endpoint, lines)


def _whole(endpoint: str, body: dict[str, Any], parsed) -> Answer:
    if endpoint == "chat":
        obj = ChatCompletion.model_validate(body, strict=True)
        assert obj.object == "chat.completion" and obj.id.startswith("chatcmpl-")
    else:
        obj = Completion.model_validate(body, strict=True)
        assert obj.object == "text_completion" and obj.id.startswith("cmpl-")
    assert parsed.model_dump() == obj.model_dump()
    assert obj.usage is not None
    ans = Answer(usage=obj.usage)
    for choice in obj.choices:
        assert choice.index not in ans.text, f"choice {choice.index} twice"
        if endpoint == "chat":
            assert choice.message.role == "assistant"
            ans.text[choice.index] = choice.message.content or ""
            if choice.logprobs is not None:
                ans.logprobs[choice.index] = list(choice.logprobs.content or [])
        else:
            ans.text[choice.index] = choice.text
            if choice.logprobs is not None:
                ans.logprobs[choice.index] = _completion_entries(choice.logprobs)
        ans.finish[choice.index] = choice.finish_reason
    assert ans.indices == list(range(len(obj.choices))), ans.indices
    return ans


def _completion_entries(lp) -> list[tuple[str, float, dict[str, float], int]]:
    """Completions logprobs as one (token, logprob, top, text_offset) per token."""
    n = len(lp.tokens)
    assert len(lp.token_logprobs) == n and len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    return list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset))


def _streamed(endpoint: str, lines: list[str]) -> Answer:
    chunks = chunks_of_lines(lines)
    ans = Answer(chunks=chunks)
    assert chunks, "no chunk before [DONE]"
    ids = set()
    for pos, body in enumerate(chunks):
        assert "error" not in body, body
        if endpoint == "chat":
            chunk = ChatCompletionChunk.model_validate(body, strict=True)
            assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        else:
            final = all(c.get("finish_reason") is not None for c in body["choices"])
            kind = Completion if body["choices"] and final else CompletionChunk
            chunk = kind.model_validate(body, strict=True)
            assert chunk.object == "text_completion" and chunk.id.startswith("cmpl-")
        ids.add(chunk.id)
        if chunk.usage is not None:  # the include_usage chunk: last, with no choices
            assert chunk.choices == [] and pos == len(chunks) - 1, body
            ans.usage = chunk.usage
            continue
        assert len(chunk.choices) >= 1, body
        for choice in chunk.choices:
            i = choice.index
            assert ans.finish.get(i) is None, f"choice {i} continued after its finish_reason"
            if endpoint == "chat":
                first = i not in ans.text
                assert (choice.delta.role == "assistant") == first, (i, body)
                piece = choice.delta.content or ""
                if choice.logprobs is not None:
                    ans.logprobs.setdefault(i, []).extend(choice.logprobs.content or [])
            else:
                piece = choice.text
                if choice.logprobs is not None:
                    ans.logprobs.setdefault(i, []).extend(_completion_entries(choice.logprobs))
            ans.text[i] = ans.text.get(i, "") + piece
            ans.finish[i] = choice.finish_reason
    assert len(ids) == 1, ids
    for i in ans.indices:
        assert ans.finish[i] in ("stop", "length"), f"choice {i} never finished: {ans.finish}"
    return ans


@cache
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def token_texts(model_dir: Path | str) -> dict[str, list[int]]:
    """Text of each single token -> the ids that decode to it (the served vocabulary)."""
    tok = hf_tokenizer(str(model_dir))
    out: dict[str, list[int]] = {}
    for i in range(len(tok)):
        out.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    return out


def plain(token: str) -> bool:
    """A token whose text is plain ASCII letters, digits and spaces: its text appears
    verbatim in the decoded output, whatever tokens come before or after it."""
    return bool(token) and token.isascii() and all(c.isalnum() or c == " " for c in token)


def assert_bad_param(exc: openai.BadRequestError, param: str) -> None:
    """A 400 with an OpenAI error body naming `param`."""
    assert exc.status_code == 400, exc
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert exc.param == param or (exc.param or "").startswith(param + "."), (param, body)
