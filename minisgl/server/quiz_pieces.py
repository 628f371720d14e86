"""The quiz's pieces in the request path: the API server with a learner's q3-q7 code in
place of ours (the quiz's capstone, tests/quiz/test_capstone.py).

Contract: when the environment variable MINISGL_QUIZ_DIR names a folder holding the quiz's
exercise files (tests/quiz/exercises/ or a copy, same file names; `FILES`),
`from_environment()` loads q3..q7 from it in the API server process at start-up; the
launcher builds the frontend with `QuizPieces.frontend` and calls `QuizPieces.install(app)`.
Unset, it returns None and the server runs its own code. Whose code runs where:
- q3 `ReplyInbox`: every RequestState put into `frontend.states` gets a new inbox as its
  buffer, wrapped in `InboxBuffer` (which keeps what the inbox does not: token counts, the
  finish reason, an error, the bytes pending), and the inbox's `event` as its wake-up event.
- q4 `wait_for_ack(state)`: the consumer loop of every response, streamed or not.
- q5 `route(states, replies)`: the listener's work on each batch of UserReplies; the state
  queries of /debug/lifecycle and the slow-client cap stay ours, around it.
- q6 `stream_chat(outputs, send, model)`: the body of every streamed chat completion that
  asks for nothing it does not write (usage, logprobs, tool calls, a reasoning parser:
  those stay ours); each send still goes through `frontend.sending` (the stall sweeper).
- q7 `request_scope(states, uid, make_msg, send_one)`: the scope of every request; the
  admission check, the uid, the fair shares and the observers' received/ended stay ours,
  around it.
The rest is ours: the workers, the routes, the non-streamed body, the error bodies. The
pieces serve one prompt and one choice per request, text only: a list of prompts, n > 1
or logprobs are refused with a 400. The metrics and the request timelines do not hear the
replies (first output, tokens) in this mode: the listener's observers are ours to call
and `route` has no place for them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request

from minisgl.message import ErrorInfo, ErrorKind, TokenizeMsg, UserReply

from .buffer import ChoiceOutput, Output, ReplyBuffer
from .chat import ChatCompletionRequest, v1_chat_completions
from .errors import RequestFailed
from .frontend import FrontendManager, RequestState
from .memory import text_bytes
from .middleware import client_var, request_id_var
from .response import Job, Send, StreamResponse

logger = logging.getLogger(__name__)

QUIZ_DIR_ENV = "MINISGL_QUIZ_DIR"
# question -> its exercise file (as tests/quiz/quiz_material.py names them)
FILES = {
    "q3": "q3_buffer_and_event.py",
    "q4": "q4_consumer_loop.py",
    "q5": "q5_route_by_uid.py",
    "q6": "q6_sse_stream.py",
    "q7": "q7_request_scope.py",
}
CHAT_PATH = "/v1/chat/completions"


@dataclass
class QuizPieces:
    folder: Path
    inbox: Callable[[], Any]  # q3's ReplyInbox: deliver(reply), take() -> (text, finished), event
    wait_for_ack: Callable[[RequestState], AsyncIterator[Output]]  # q4
    route: Callable[[dict[int, RequestState], list[UserReply]], None]  # q5
    stream_chat: Callable[[AsyncIterator[Output], Send, str], Any]  # q6
    request_scope: Callable[..., Any]  # q7: an async context manager

    @classmethod
    def load(cls, folder: Path) -> QuizPieces:
        mods = {q: _load(folder / name) for q, name in FILES.items()}
        return cls(
            folder,
            mods["q3"].ReplyInbox,
            mods["q4"].wait_for_ack,
            mods["q5"].route,
            mods["q6"].stream_chat,
            mods["q7"].request_scope,
        )

    def frontend(self, *args: Any, **kwargs: Any) -> QuizFrontend:
        """A FrontendManager (same arguments) that runs these pieces."""
        return QuizFrontend(*args, pieces=self, **kwargs)

    def install(self, app: FastAPI) -> None:
        """Streamed chat completions of `app` answered by `stream_chat` (q6)."""
        router = APIRouter()
        router.add_api_route(CHAT_PATH, self._chat, methods=["POST"])
        app.router.routes.insert(0, router.routes[0])  # matched ahead of chat.py's route
        logger.info("serving with the quiz's pieces from %s (%s)", self.folder, QUIZ_DIR_ENV)

    async def _chat(self, req: ChatCompletionRequest, request: Request):
        response = await v1_chat_completions(req, request)
        if isinstance(response, StreamResponse) and _writes_all_of(response.job):
            return QuizStreamResponse(response.frontend, response.job, self.stream_chat)
        return response


def from_environment() -> QuizPieces | None:
    folder = os.environ.get(QUIZ_DIR_ENV)
    return QuizPieces.load(Path(folder).resolve()) if folder else None


def _load(path: Path) -> ModuleType:
    if not path.is_file():
        raise FileNotFoundError(f"{QUIZ_DIR_ENV}: no exercise file {path}")
    spec = importlib.util.spec_from_file_location(f"quiz_pieces_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _writes_all_of(job: Job) -> bool:
    """Whether q6's stream writes everything this streamed chat request asks for."""
    fmt = job.fmt
    return not (job.include_usage or fmt.continuous_usage or fmt.tools or fmt.reasoning)


def _refuse_unless_servable(msg: TokenizeMsg) -> None:
    params = msg.sampling_params
    if params.n != 1:
        message = "the quiz's pieces serve one choice per request (n = 1)"
        raise RequestFailed(ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, message, "n"))
    if params.logprobs is not None or params.prompt_logprobs is not None:
        message = "the quiz's pieces carry text only: no logprobs"
        raise RequestFailed(ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, message, "logprobs"))


class InboxBuffer(ReplyBuffer):
    """A ReplyBuffer whose text and end are a q3 ReplyInbox's: `append` delivers each reply
    to the inbox, `take` builds the Output from what the inbox gives back. The consumer
    hears of the end only from the inbox, or from `finish` (an end decided here: the
    slow-client cap, a dead worker)."""

    def __init__(self, inbox: Any) -> None:
        super().__init__()
        self.inbox = inbox
        self.ended_here = False

    def append(self, reply: UserReply) -> bool:
        self.inbox.deliver(reply)
        choice = self.choices[0]
        if reply.incremental_output:
            self.pending_bytes += text_bytes(reply.incremental_output)
        choice.tokens = max(choice.tokens, reply.completion_tokens)
        self.prompt_tokens = max(self.prompt_tokens, reply.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, reply.cached_tokens)
        if reply.finish_reason is not None:
            choice.finish_reason = reply.finish_reason
        if reply.finished:  # for the request's outcome; the consumer learns it from the inbox
            self.finished, self.error = True, reply.error
        return self.inbox.event.is_set()  # the wake-up is the inbox's to give

    def finish(self, error: ErrorInfo | None = None) -> None:
        super().finish(error)
        self.ended_here = True

    def take(self) -> Output:
        text, finished = self.inbox.take()
        choice, reason = self.choices[0], None
        if finished and not choice.finish_taken:
            reason, choice.finish_taken = choice.finish_reason, True
        ended = finished or self.ended_here
        self.pending_bytes = 0
        return Output(
            [ChoiceOutput(0, text, reason, [])] if text or reason else [],
            self.prompt_tokens,
            self.completion_tokens,
            ended,
            self.error if ended else None,
            self.cached_tokens if self.report_cached else None,
        )


class InboxStates(dict):
    """`frontend.states`: each RequestState put in gets a new inbox (q3) as its buffer, and
    the inbox's event as its wake-up event, before the listener can find it."""

    def __init__(self, make_inbox: Callable[[], Any]) -> None:
        super().__init__()
        self.make_inbox = make_inbox

    def __setitem__(self, uid: int, state: RequestState) -> None:
        if not isinstance(state.buffer, InboxBuffer):
            inbox = self.make_inbox()
            state.buffer, state.event = InboxBuffer(inbox), inbox.event
        super().__setitem__(uid, state)


class QuizFrontend(FrontendManager):
    def __init__(self, *args: Any, pieces: QuizPieces, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pieces = pieces
        self.states = InboxStates(pieces.inbox)

    @asynccontextmanager
    async def request(
        self, make_msg: Callable[[int], TokenizeMsg], n: int = 1, event: Any = None
    ) -> AsyncIterator[RequestState]:
        self.check_admission()
        uid, client = next(self.uid_counter), client_var.get()

        def make(uid: int) -> TokenizeMsg:
            msg = make_msg(uid)
            _refuse_unless_servable(msg)
            return msgspec.structs.replace(msg, client=client)

        self.shares.take(uid, client)
        try:
            async with self.pieces.request_scope(self.states, uid, make, self.send_one) as state:
                state.request_id = request_id_var.get()
                self.observer.received(state)
                try:
                    yield state
                finally:
                    outcome, code = state.outcome()
                    self.observer.ended(state, outcome, code=code)
        finally:
            self.shares.give_back(uid)

    @asynccontextmanager
    async def requests(
        self, make_msgs: list[Callable[[int], TokenizeMsg]], n: int = 1
    ) -> AsyncIterator[list[RequestState]]:
        if len(make_msgs) != 1:
            message = "the quiz's pieces serve one prompt per request"
            raise RequestFailed(ErrorInfo(ErrorKind.INVALID_PROMPT, message))
        async with self.request(make_msgs[0], n) as state:
            yield [state]

    def wait_for_ack(self, *states: RequestState) -> AsyncIterator[Output]:
        (state,) = states
        return self.pieces.wait_for_ack(state)

    async def listen(self) -> None:
        while True:
            msgs = await self._recv()
            for msg in msgs:
                if not isinstance(msg, UserReply):  # a state answer, or the observers'
                    self._other(msg)
            replies = [msg for msg in msgs if isinstance(msg, UserReply)]
            self.pieces.route(self.states, replies)
            for uid in {reply.uid for reply in replies}:
                state = self.states.get(uid)
                if state is not None and not state.terminal:
                    if state.buffer.pending_bytes > self.max_pending_bytes:
                        self._fail_slow_client(state)


class QuizStreamResponse(StreamResponse):
    """A streamed chat completion whose body is q6's `stream_chat`."""

    def __init__(self, frontend: FrontendManager, job: Job, stream_chat: Callable) -> None:
        super().__init__(frontend, job)
        self.stream_chat = stream_chat

    async def serve(self, send: Send) -> None:
        job = self.job
        async with self.frontend.requests(job.make_msgs, job.n) as states:

            async def send_watched(message: dict[str, Any]) -> None:
                with self.frontend.sending(states[0]):
                    await send(message)

            async with aclosing(self.frontend.wait_for_ack(*states)) as outputs:
                await self.stream_chat(outputs, send_watched, job.fmt.model)
