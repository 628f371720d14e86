"""The tokenizer worker: text -> token ids on the way in, ids -> text on the way out.

Contract (per uid), one branch of `handle` per message:
- TokenizeMsg: the worker's `prepare` (tokenizer/prepare.py: tokenizing, compiling the
  constraint, off this loop where that is slow) makes the prompt ids; `_start` then creates
  the decode state and sends UserMsg to the scheduler, or answers a refused request at once
  with an error UserReply.
- AbortMsg: drop the decode state (or the preparation) and forward AbortBackendMsg (the
  reference forwarded the abort but kept the decode state, which then leaked).
- DetokenizeMsg (consecutive ones decoded in one batch): the UserReply of that choice; a
  stop string that ends a choice stops it in the scheduler (AbortBackendMsg(uid, index));
  the reply that ends the last choice is terminal and removes the decode state; a token for
  a uid without decode state (aborted) is dropped.
- BackendErrorMsg: drop the decode state, send the error on as the terminal UserReply.
- LifecycleQueryMsg: on to the scheduler; its answer goes back with this worker's counts.
- Anything else (the scheduler's observers' batches) is this worker's observers' to take,
  or is passed on. Observers (`observe`) also hear each request tokenized, its first
  output, a stop string and its end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BackendErrorMsg,
    BackendMsg,
    DetokenizeMsg,
    FrontendMsg,
    LifecycleQueryMsg,
    LifecycleStateMsg,
    SchedulerStateMsg,
    StateQueryMsg,
    TokenizeMsg,
    TokenizerMsg,
    UserMsg,
    UserReply,
)
from minisgl.observe import Observers, RequestObserver

from .detokenize import DetokenizeManager

logger = logging.getLogger(__name__)


class TokenizerWorker:
    def __init__(
        self,
        tokenizer,
        send_backend: Callable[[list[BackendMsg]], None],
        send_frontend: Callable[[list[FrontendMsg]], None],
        prepare,
    ) -> None:
        """`prepare`: what happens to a prompt before it can start (tokenizer/prepare.py's
        `Preparation`: submit, ready, cancel, state, fds, wait_ms)."""
        self.tokenizer = tokenizer
        self.detokenize_manager = DetokenizeManager(tokenizer)
        self.send_backend = send_backend
        self.send_frontend = send_frontend
        self.prepare = prepare
        self.observer = Observers()

    def observe(self, observer: RequestObserver) -> None:
        self.observer.add(observer)

    def state(self) -> dict[str, int]:
        return {"decode_states": len(self.detokenize_manager.decode_map), **self.prepare.state()}

    def wait_ms(self, default: int) -> int:
        """How long the process loop may wait for messages before `handle([])` is due."""
        return self.prepare.wait_ms(default)

    def fds(self) -> list[int]:
        """File descriptors that wake the process loop (the preparation's)."""
        return self.prepare.fds()

    # --8<-- [start:handle]
    def handle(self, msgs: list[TokenizerMsg]) -> None:
        to_backend: list[BackendMsg] = []
        to_frontend: list[FrontendMsg] = []
        # requests prepared since the last call: large prompts tokenized, grammars compiled
        to_backend += self._start(self.prepare.ready(self.observer), to_frontend)
        run: list[DetokenizeMsg] = []  # consecutive tokens, decoded in one batch
        for msg in msgs:
            if isinstance(msg, DetokenizeMsg):
                run.append(msg)
                continue
            to_frontend += self._detokenize(run, to_backend)
            run = []
            if isinstance(msg, TokenizeMsg):
                to_backend += self._start(self.prepare.submit(msg, self.observer), to_frontend)
            elif isinstance(msg, AbortMsg):
                self._abort(msg.uid)
                to_backend.append(AbortBackendMsg(msg.uid))
            elif isinstance(msg, BackendErrorMsg):
                to_frontend += self._error(msg)
            elif isinstance(msg, LifecycleQueryMsg):
                to_backend.append(StateQueryMsg(msg.query_id, msg.flush_cache))
            elif isinstance(msg, SchedulerStateMsg):
                to_frontend.append(LifecycleStateMsg(msg.query_id, self.state(), msg.state))
            elif not self.observer.inbox(msg):  # the scheduler's observers': theirs, or on
                to_frontend.append(msg)
        to_frontend += self._detokenize(run, to_backend)
        to_frontend += self.observer.outbox()  # after the replies its events describe
        self.send_backend(to_backend)
        self.send_frontend(to_frontend)

    # --8<-- [end:handle]

    def _start(self, prepared: list, to_frontend: list[FrontendMsg]) -> list[BackendMsg]:
        """Prepared requests go to the scheduler; their decode state is created here, with
        the prompt, never by a first token. A refused one gets one error reply, no decode
        state, and nothing is sent on."""
        to_backend: list[BackendMsg] = []
        for p in prepared:
            msg, params = p.msg, p.msg.sampling_params
            if p.error is not None:
                self.observer.ended(msg.uid, "error", kind=p.error.kind.value)
                to_frontend.append(UserReply(msg.uid, finished=True, error=p.error))
                continue
            echo = ""
            if msg.echo:
                echo = msg.text
                if echo is None:
                    echo = self.tokenizer.decode(p.ids, skip_special_tokens=False)
            prompt_ids = p.ids if params.prompt_logprobs is not None else None
            self.detokenize_manager.add(
                msg.uid,
                len(p.ids),
                params.n,
                params.stop,
                params.min_tokens,
                echo=echo,
                prompt_ids=prompt_ids,
            )
            if p.reasoning_open:  # the output starts as reasoning: say so ahead of it
                to_frontend.append(UserReply(msg.uid, reasoning_open=True))
            to_backend.append(UserMsg.make(msg.uid, p.ids, params, p.grammar, msg.client))
        return to_backend

    def _abort(self, uid: int) -> None:
        """Drop the request's decode state, or its preparation (its tokens or grammar are
        dropped when they come)."""
        if self.prepare.cancel(uid) or uid in self.detokenize_manager.decode_map:
            self.observer.ended(uid, "aborted")
        self.detokenize_manager.remove(uid)

    def _detokenize(
        self, run: list[DetokenizeMsg], to_backend: list[BackendMsg]
    ) -> list[FrontendMsg]:
        """The replies to a run of tokens (decoded in one batch); a choice that a stop string
        ended is stopped in the scheduler."""
        if not run:
            return []
        replies: list[FrontendMsg] = []
        decoded, stopped = self.detokenize_manager.feed(run)
        for i, (msg, reply) in enumerate(zip(run, decoded)):
            if reply is None:
                continue  # late token of an aborted request or stopped choice: dropped
            if reply.completion_tokens == 1 and msg.index == 0:
                self.observer.first_output(msg.uid)
            if i in stopped:
                to_backend.append(AbortBackendMsg(msg.uid, msg.index))
                self.observer.event(msg.uid, "stop_string", index=msg.index)
            if reply.finished:
                self.observer.ended(msg.uid, "finished", reason=reply.finish_reason)
            replies.append(reply)
        return replies

    def _error(self, msg: BackendErrorMsg) -> list[FrontendMsg]:
        state = self.detokenize_manager.decode_map.get(msg.uid)
        if state is None:
            return []  # already aborted: the API server has forgotten this uid
        self.detokenize_manager.remove(msg.uid)
        self.observer.ended(msg.uid, "error", kind=msg.error.kind.value)
        generated = sum(c.tokens for c in state.choices)
        return [
            UserReply(
                msg.uid,
                finished=True,
                error=msg.error,
                prompt_tokens=state.prompt_tokens,
                completion_tokens=generated,
            )
        ]
