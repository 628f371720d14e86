"""Policy: which sequences run in each step, over an explicit status per sequence.

Contract (vLLM v1's shape; the step loop in scheduler.py drives it; built from the engine's
`Limits` alone, so a unit test builds it with no model):
- `add(msg)` admits one `UserMsg`, or answers at once with a `BackendErrorMsg` what only
  the model knows to refuse: an empty prompt, one that leaves no room to generate, a token
  id outside the vocabulary. A constrained request first waits for its grammar matcher
  (constrained.py); `admit_built(uids)` queues those whose matcher is built.
- `abort(uid, index)` removes the request (or one choice) wherever it is and frees its
  slots and pages; a uid it does not know is ignored (it may have just finished).
- `schedule()` is the next `Step` (every decoding sequence, then prefill chunks under the
  token budget) or None; `launched(step)` moves the sequences' host state on once the
  engine has read it; `update(step, output)` reads the step's tokens: one `DetokenizeMsg`
  per sequence that produced one, the last carrying its finish_reason, its resources
  already free.
- `state()` is its answer to a state query; `fail_all(error)` an error for every request.
Each sequence (one choice; n choices share the prompt's pages) has a `Req.status`, set at
every transition. Under overlap a sequence's latest token is still on the device when the
next step is scheduled: one that ends while a launched step holds it is freed at once,
exactly once, and that step's token for it is dropped when read (`Req.ended`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from minisgl.core import Batch, PromptScores, Req, ReqStatus, SamplingParams
from minisgl.message import (
    BackendErrorMsg,
    DetokenizeMsg,
    ErrorInfo,
    ErrorKind,
    SchedulerState,
    TokenizerMsg,
    UserMsg,
)
from minisgl.observe import RequestObserver

from .cache import CacheManager
from .choices import fork_choices
from .config import SchedulerConfig
from .constrained import Constrained
from .decode import DecodeManager
from .limits import Limits
from .pacing import ChunkBudget
from .prefill import PrefillManager
from .table import TableManager

logger = logging.getLogger(__name__)


def _error(
    msg: UserMsg, kind: ErrorKind, message: str, field: str | None = None
) -> BackendErrorMsg:
    return BackendErrorMsg(msg.uid, ErrorInfo(kind, message, field))


class Step:
    """A scheduled batch and what the policy reads back from it: who samples (decided
    before `cached_len` moves) and, once launched, who samples from the prompt, whose
    prompt it scores and which max_tokens 0 sequences end with it."""

    __slots__ = ("batch", "sampling", "first", "scoring", "prefilled")

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.sampling: list[Req] = batch.sampling_reqs
        self.first: list[Req] = []  # the sequences that sample from their prompt
        self.scoring: list[Req] = []  # per entry of the batch's `scoring`: whose prompt
        self.prefilled: list[Req] = []  # max_tokens 0: prompts cached in this step


class Policy:
    def __init__(
        self,
        limits: Limits,
        config: SchedulerConfig,
        observer: RequestObserver,
        seeds: random.Random,
        budget: Callable[[list[Req], int], ChunkBudget],
        matchers: Any = None,
    ) -> None:
        """`limits`: what the engine can hold; `seeds` draws the seed of a request that
        brings none; `budget(decodes, waiting)` is a step's prompt work (pacing.py);
        `matchers` builds, copies and advances the grammar matchers of constrained
        requests (engine/grammar.py's `Grammars`)."""
        self.observer = observer  # the scheduler's observers (minisgl/observe.py)
        self.limits = limits
        self.table_manager = TableManager(limits.max_running_requests)
        self.cache_manager = CacheManager(
            limits.num_pages, limits.page_size, prefix_cache=config.prefix_cache == "radix"
        )
        self.prefill_manager = PrefillManager()
        self.decode_manager = DecodeManager()
        self.constrained = Constrained(matchers)  # requests a grammar constrains
        self._seeds = seeds
        self._budget = budget
        self.num_preemptions = 0  # requests evicted for recompute since start

    # ------------------------------------------------------------------ state
    @property
    def runnable(self) -> bool:
        """A step would have something to run."""
        return self.prefill_manager.runnable or self.decode_manager.runnable

    @property
    def building(self) -> bool:
        """Some request waits for its matcher."""
        return bool(self.constrained)

    def state(self) -> SchedulerState:
        return SchedulerState(
            pending=len(self.prefill_manager) + len(self.constrained),
            running=len(self.decode_manager),
            table_slots_used=self.table_manager.used,
            **self.cache_manager.counts(),  # KV pages and the prefix cache
            # sequences whose output a grammar constrains (each holds a matcher)
            grammar_matchers=sum(
                r.matcher is not None
                for r in (*self.prefill_manager.pending, *self.decode_manager.running.values())
            ),
        )

    def fail_all(self, error: ErrorInfo) -> list[TokenizerMsg]:
        """The scheduler cannot go on (its ranks fell out of step): an error reply for
        every request it holds. Their state stays: the process exits next."""
        uids = {r.uid for r in self.prefill_manager.pending}
        uids |= {uid for uid, _ in self.decode_manager.running}
        uids |= set(self.constrained.building)
        return [BackendErrorMsg(uid, error) for uid in sorted(uids)]

    # ------------------------------------------------------------------ admission
    # --8<-- [start:validate]
    def add(self, msg: UserMsg) -> BackendErrorMsg | None:
        ids, params = msg.input_ids, msg.sampling_params
        max_seq_len, vocab = self.limits.max_seq_len, self.limits.vocab_size
        if not ids:
            return _error(msg, ErrorKind.EMPTY_PROMPT, "the prompt is empty")
        if len(ids) >= max_seq_len:
            return _error(
                msg,
                ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(ids)} tokens, but this server's context is "
                f"{max_seq_len} tokens and at least one must be left to generate; "
                "shorten the prompt",
            )
        for field, token_ids in (
            (None, ids),  # the prompt, whatever the endpoint calls it
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
        ):
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
                where = field or "the prompt"
                message = f"{where}: token ids must be in [0, {vocab})"
                return _error(msg, ErrorKind.INVALID_TOKEN_ID, message, field)
        constrained = params.json_schema is not None or params.grammar is not None
        if constrained and msg.grammar is None:  # a caller that skipped the compile step
            field = "json_schema" if params.json_schema is not None else "grammar"
            message = f"{field} reached the scheduler uncompiled (compile it first)"
            return _error(msg, ErrorKind.INVALID_SAMPLING_VALUE, message, field)
        # more than the room left is clamped; hitting the clamp is finish_reason "length"
        room = max_seq_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Req(
            uid=msg.uid,
            token_ids=ids,
            prompt_len=len(ids),
            max_len=len(ids) + max_tokens,
            sampling_params=params,
            seed=self._seed_for(params, 0),
            eos_token_ids=self.limits.eos_token_ids,
            forks_left=params.n - 1,  # the other choices fork off once the prompt is cached
            client=msg.client,
            prompt_scores=PromptScores() if params.prompt_logprobs is not None else None,
        )
        if constrained:  # queued once its matcher is built, off this loop
            self.constrained.start(req, msg.grammar)
        else:
            self.prefill_manager.add_req(req)  # WAITING
        return None

    # --8<-- [end:validate]

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        """A user's seed makes every choice reproducible; otherwise each gets a fresh one."""
        if params.seed is None:
            return self._seeds.getrandbits(63)
        return params.seed + index

    def admit_built(self, uids: list[int]) -> list[TokenizerMsg]:
        """Queue the requests whose matcher is built (`constrained.ready()`); one whose
        grammar the library refused after all ends with an error."""
        errors: list[TokenizerMsg] = []
        for req, error in self.constrained.admit(uids):
            if error is None:
                req.status = ReqStatus.WAITING
                self.prefill_manager.add_req(req)
                continue
            req.status = ReqStatus.ABORTED
            self.observer.ended(req.uid, "error", kind=error.kind.value)
            errors.append(BackendErrorMsg(req.uid, error))
        return errors

    def _fork(self, first: Req) -> None:
        """The request's other choices start from `first`'s cached prompt (choices.py)."""
        copy = self.constrained.copy
        children = fork_choices(first, self.cache_manager, self._seed_for, copy)
        first.forks_left = 0
        self.prefill_manager.readmit(children)  # WAITING, at the front

    # --8<-- [start:abort_req]
    def abort(self, uid: int, index: int | None = None, how: str = "aborted") -> list[Req]:
        """Remove a request's sequences (one choice, or all) wherever they are (`how` it
        ended, for the timeline: "aborted", or "error")."""
        if (req := self.constrained.drop(uid)) is not None:  # its matcher was building
            req.status = ReqStatus.ABORTED  # (it holds nothing yet)
            self.observer.ended(req, how, sequences=1 + req.forks_left)
            return [req]
        reqs = self.prefill_manager.abort_req(uid, index)
        reqs += self.decode_manager.abort_req(uid, index)
        for req in reqs:
            # one choice stopped by a stop string, or all
            self.observer.ended(req, how if index is None else "stop", sequences=1 + req.forks_left)
            req.forks_left = 0  # an aborted first choice forks no others
            req.status = ReqStatus.ABORTED  # a token a launched step still makes is dropped
            self._free_req_resources(req)
        return reqs

    def _free_req_resources(self, req: Req) -> None:
        """Give back a sequence's pages and slot; it may be readmitted from scratch later."""
        self.cache_manager.release(req)
        if req.table_idx >= 0:
            self.table_manager.free(req.table_idx)
            req.table_idx = -1
        req.cached_len = 0
        req.extend_len = 0

    # --8<-- [end:abort_req]

    # ------------------------------------------------------------------ one step
    # --8<-- [start:schedule]
    def schedule(self) -> Step | None:
        """The next step's batch: every decoding sequence that can grow (preempting the
        newest when pages run out), then prefill chunks under the token budget."""
        self._make_room_for_decode()
        decode, preempted = self.decode_manager.schedule_next(
            self.cache_manager, self._free_req_resources
        )
        for req in preempted:
            req.status = ReqStatus.PREEMPTED
            self.observer.event(req, "preempted")
        if preempted:
            self.num_preemptions += len(preempted)
            logger.info("KV cache full: preempted %d request(s) for recompute", len(preempted))
            self.prefill_manager.readmit(preempted)
        budget = self._budget(decode, len(self.prefill_manager))
        prefill = self.prefill_manager.schedule_next(
            budget, self.table_manager, self.cache_manager, keep_free=len(decode), running=decode
        )
        reqs = decode + prefill
        return Step(Batch(reqs, decodes=len(decode))) if reqs else None

    # --8<-- [end:schedule]

    def _make_room_for_decode(self) -> None:
        """Partly prefilled requests are the newest holders of pages: if running requests
        cannot all grow by one token, those give their pages back first."""
        cache = self.cache_manager
        if not any(r.pages for r in self.prefill_manager.pending):
            return  # nothing to take back (the common case)
        needed = sum(
            cache.next_token_pages(
                r for r in self.decode_manager.running.values() if r.seq_len < r.max_len
            )
        )
        for req in reversed(self.prefill_manager.pending):
            if needed <= cache.available:
                break
            if req.pages:
                self._take_back(req)

    def _take_back(self, req: Req) -> None:
        """A sequence in the prefill manager gives its pages and slot back: it waits again,
        to be prefilled from scratch (its scored prompt positions stay scored)."""
        self._free_req_resources(req)
        if req.status is ReqStatus.PREFILLING:
            req.status = ReqStatus.WAITING

    # --8<-- [start:launched]
    def launched(self, step: Step) -> None:
        """The engine has launched `step` (reading the sequences' host state): that state
        moves on at once, as if the step had run."""
        batch = step.batch
        step.scoring = [batch.reqs[i] for i, _, _, _ in batch.scoring]
        for req, (_, start, count, _) in zip(step.scoring, batch.scoring):
            req.prompt_scores.launched = start + count  # never scored twice, even if recomputed
        for req in batch.reqs[: batch.decodes]:  # one token each, sampled; already running
            req.cached_len += 1
            req.extend_len = 0
            req.num_pending += 1  # its token is on the device until update()
        for req in batch.reqs[batch.decodes :]:  # prefill chunks
            req.cached_len += req.extend_len
            req.extend_len = 0
            req.status = ReqStatus.PREFILLING  # RUNNING below once its prompt is cached
            self.cache_manager.insert(req)  # its full pages are shared from the next step on
        step.first = step.sampling[batch.decodes :]
        for req in step.first:  # prompts cached by this step: they decode
            req.num_pending += 1
            if req.forks_left:  # the request's other choices start from its pages
                self._fork(req)
            req.status = ReqStatus.RUNNING
            self.decode_manager.add_req(req)  # it left the prefill manager with this chunk
        # max_tokens 0: a prompt cached by this step with nothing to sample ends when the
        # step is read (its prompt logprobs with it); until then it waits with the running
        step.prefilled = [
            r for r in batch.reqs[batch.decodes :] if r.cached_len == r.seq_len >= r.max_len
        ]
        for req in step.prefilled:
            req.status = ReqStatus.RUNNING
            self.decode_manager.add_req(req)

    # --8<-- [end:launched]

    # --8<-- [start:finish_step]
    def update(self, step: Step, out: Any) -> list[TokenizerMsg]:
        """Read a launched step's tokens (the engine's `StepOutput`): one reply per sequence
        that had not ended."""
        for req, values in zip(step.scoring, out.prompt_logprobs or [], strict=True):
            if not req.ended:
                req.prompt_scores.values += values
        logprobs = out.logprobs or [None] * len(out.tokens)
        replies: list[TokenizerMsg] = []
        for req, token, logprob in zip(step.sampling, out.tokens, logprobs, strict=True):
            if req.ended:
                continue  # aborted or finished after this step was launched
            req.append_token(token)
            if req.matcher is not None and (error := self.constrained.follow(req, token)):
                self.abort(req.uid, how="error")  # it can no longer satisfy its constraint
                replies.append(BackendErrorMsg(req.uid, error))
                continue
            reply = DetokenizeMsg(req.uid, token, req.finish_reason, req.index, logprob)
            if req.cached_tokens:  # reported once, with its first token (for usage)
                reply.cached_tokens, req.cached_tokens = req.cached_tokens, 0
            if req.prompt_scores is not None:  # its first token: the prompt's logprobs go too
                reply.prompt_logprobs, req.prompt_scores = req.prompt_scores.values, None
            replies.append(reply)
            if req.finish_reason is not None:
                self._end(req)
        for req in step.prefilled:
            if not req.ended:
                replies += self._end_prefilled(req)
        for req in step.first:  # sequences that sampled from their prompt
            self.observer.first_output(req)
        return replies

    # --8<-- [end:finish_step]

    def _end_prefilled(self, req: Req) -> list[TokenizerMsg]:
        """A max_tokens 0 sequence ends with its prompt: every choice of the request at once
        (they would all be the prompt), with no token; choice 0 carries the prompt logprobs."""
        req.finish_reason = "length"
        scores, req.prompt_scores = req.prompt_scores, None
        replies: list[TokenizerMsg] = [
            DetokenizeMsg(req.uid, None, "length", index) for index in range(1 + req.forks_left)
        ]
        if scores is not None:
            replies[0].prompt_logprobs = scores.values
        self._end(req)
        return replies

    # --8<-- [start:end_sequence]
    def _end(self, req: Req) -> None:
        """A finished sequence leaves whichever manager holds it and frees what it holds."""
        running = req.status is ReqStatus.RUNNING  # else preempted while its token was pending
        req.status = ReqStatus.FINISHED
        # with the choices it never forked (max_tokens 0)
        self.observer.ended(req, req.finish_reason or "stop", sequences=1 + req.forks_left)
        req.forks_left = 0
        self.cache_manager.insert(req)  # the next turn of a conversation starts with it
        if running:
            self.decode_manager.remove_req(req)
        else:
            self.prefill_manager.remove_req(req)
        self._free_req_resources(req)

    # --8<-- [end:end_sequence]
