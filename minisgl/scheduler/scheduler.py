"""Scheduler: admits requests by uid, batches them continuously, and answers once per step.

Contract (the message-shaped interface the server drives):
- `process_msg(msg)` takes one incoming message. A `UserMsg` is checked first against what
  only the model knows: an empty prompt, one that leaves no room to generate, a token id
  outside the vocabulary are answered at once with a `BackendErrorMsg` for that uid, never
  dropped. The sampling values' own rules (`SamplingParams.validate`) were checked where
  the request entered (the HTTP request model, `LLM.generate`). `AbortBackendMsg`
  removes the request (or one of its choices) wherever it is (waiting, mid-chunked-prefill,
  decoding) and frees its slots and pages; a uid the scheduler does not know is ignored (it
  may have just finished).
- `step()` runs one forward pass over every decoding sequence plus as many prefill chunks
  as the token budget (`SchedulerConfig.max_prefill_tokens`) allows, and returns one
  `DetokenizeMsg` per sequence that produced a token; the last one of a sequence carries
  its finish_reason, and its resources are already free when it is returned.
- `advance()` is what the loop calls instead: with overlap scheduling it launches the next
  step and then returns the replies of the step launched before it, so the host schedules
  step N+1 and reads step N's tokens while the device runs step N+1; without overlap it is
  `step()`. Both are `launch_step()` followed, now or one call later, by `finish_step()`.
- `run_forever(io)` is the process loop: receive, advance, send.

With tensor parallelism there is one scheduler per rank, and rank 0's decides: each of
its calls that changes state (`process_msg`, `advance`, `step`) is first broadcast to the
others, whose `follow()` loop makes the same call, so every rank schedules the same batch
in the same step. Seeds come from one generator seeded alike on every rank; the sampled
tokens are rank 0's (the sampler broadcasts them). A state query gathers every rank's
state into rank 0's answer (`ranks`). `stop_followers()` ends their loops.

Under overlap a sequence's latest token is *pending* (on the device) while the next step is
scheduled: it decodes from the device copy, and whether that token ended the sequence is
known one step late. So a sequence that ends (finish, abort, error) while a launched step
still holds it is freed at once, exactly once (`_end`); the launched step's work for it is
wasted and its token is dropped when that step's results are read (`ended`). A sequence
whose length alone ends it is not scheduled past its last token.

Each sequence (one choice of a request; n choices share the prompt's pages) lives in
exactly one of the prefill manager (waiting or partly prefilled) and the decode manager
(running), and is removed on finish, abort and error.
"""

from __future__ import annotations

import logging
import os
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for_futures
from typing import Protocol

from msgspec import UNSET

from minisgl.core import Batch, PromptScores, Req, SamplingParams
from minisgl.distributed import (
    broadcast_object,
    gather_objects,
    sleep_until_woken,
    tp,
    wake_followers,
)
from minisgl.engine.engine import Engine, StepHandle
from minisgl.engine.grammar import GrammarError, Grammars, advance
from minisgl.message import (
    AbortBackendMsg,
    BackendErrorMsg,
    BackendMsg,
    DetokenizeMsg,
    ErrorInfo,
    ErrorKind,
    SchedulerState,
    SchedulerStateMsg,
    StateQueryMsg,
    TimelineMsg,
    TokenizerMsg,
    UserMsg,
)

from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .pacing import PrefillPacer
from .prefill import PrefillManager
from .table import TableManager
from .timeline import SchedulerRecorder

logger = logging.getLogger(__name__)

DEFAULT_CPU_STEP_SECONDS = 0.3  # SchedulerConfig.prefill_step_seconds on a CPU


def _error(
    msg: UserMsg, kind: ErrorKind, message: str, field: str | None = None
) -> BackendErrorMsg:
    return BackendErrorMsg(msg.uid, ErrorInfo(kind, message, field))


class SchedulerIO(Protocol):
    def receive(self, blocking: bool) -> list[BackendMsg]: ...

    def send(self, replies: list[TokenizerMsg]) -> None: ...


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
        timeline: SchedulerRecorder | None = None,
    ) -> None:
        self.engine = engine
        # the server's request timelines (a SchedulerTimeline); by default none recorded
        self.timeline = timeline if timeline is not None else SchedulerRecorder()
        engine.record_with(self.timeline)  # the engine marks its phases of each step there
        self.steps = 0  # steps launched since start
        self.config = config if config is not None else SchedulerConfig()
        self.table_manager = TableManager(engine.config.max_running_requests)
        self.cache_manager = CacheManager(
            engine.num_pages,
            engine.page_size,
            engine.page_table,
            prefix_cache=self.config.prefix_cache == "radix",
        )
        self.prefill_manager = PrefillManager()
        self.decode_manager = DecodeManager()
        self.eos_token_ids = engine.model_config.eos_token_ids
        self.grammars = Grammars(engine.model_dir, engine.model_config.vocab_size)
        # constrained requests whose matcher is being built (off the loop), by uid
        self._building: dict[int, tuple[Req, Future]] = {}
        self.tp = tp()
        self._seeds = random.SystemRandom()
        if self.tp.size > 1:  # the same seeds on every rank, drawn in the same order
            self._seeds = random.Random(broadcast_object(self._seeds.getrandbits(63)))
        self.num_preemptions = 0  # requests evicted for recompute since start
        overlap = self.config.overlap_schedule
        self.overlap = engine.device.type == "cuda" if overlap is None else overlap
        if self.overlap:  # the engine's start-up self-check may fall back to synchronous steps
            self.overlap = engine.check_overlap()
        pace = self.config.prefill_step_seconds
        if pace is None:  # a CPU runs a step inside its launch: it can be timed and paced
            pace = DEFAULT_CPU_STEP_SECONDS if engine.device.type == "cpu" else 0
        self.pacer = PrefillPacer(self.config.max_prefill_tokens, pace or None)
        self._in_flight: _Launched | None = None  # launched, results not read yet
        self._rests = 0  # rank 0: rest periods so far (the others sleep through them)
        self._resting = False

    # ------------------------------------------------------------------ messages
    @property
    def has_work(self) -> bool:
        return self._can_step or bool(self._building)

    @property
    def _can_step(self) -> bool:
        return (
            self._in_flight is not None
            or self.prefill_manager.runnable
            or self.decode_manager.runnable
        )

    def state(self) -> SchedulerState:
        return SchedulerState(
            pending=len(self.prefill_manager) + len(self._building),
            running=len(self.decode_manager),
            table_slots_used=self.table_manager.used,
            kv_pages_used=self.cache_manager.used,  # held by live requests
            kv_pages_total=self.cache_manager.total,
            kv_pages_cached=self.cache_manager.cached,  # held by the prefix cache alone
            prefix_cache_nodes=self.cache_manager.nodes,
            prefix_cache_query_tokens=self.cache_manager.query_tokens,
            prefix_cache_hit_tokens=self.cache_manager.hit_tokens,
            # sequences whose output a grammar constrains (each holds a matcher)
            grammar_matchers=sum(
                r.matcher is not None
                for r in (*self.prefill_manager.pending, *self.decode_manager.running.values())
            ),
        )

    # ------------------------------------------------------------------ ranks
    def _mirror(self, op: str, arg=None) -> None:
        """Rank 0: tell the other ranks' schedulers to make the same call."""
        if self.tp.size > 1 and self.tp.leader:
            if self._resting:
                wake_followers(self._rests)
                self._resting = False
            broadcast_object((op, arg))

    def rest_followers(self) -> None:
        """Rank 0, about to wait for work (for as long as it takes): the other ranks wait
        on the rendezvous store, not inside a collective that would time out."""
        if self.tp.size > 1 and self.tp.leader and not self._resting:
            self._rests += 1
            broadcast_object(("rest", self._rests))
            self._resting = True

    def follow(self, alive=lambda: True) -> None:
        """A rank other than 0: make rank 0's calls until it stops us."""
        while True:
            op, arg = broadcast_object()
            if op == "exit":
                return
            if op == "rest":
                sleep_until_woken(arg, alive)
            elif op == "msgs":
                for msg in arg:
                    self._process(msg)
            elif op == "advance":
                self._advance(arg)
            elif op == "step":
                self._step(arg)

    def stop_followers(self) -> None:
        self._mirror("exit")

    def process_msg(self, msg: BackendMsg) -> list[TokenizerMsg]:
        return self.process_msgs([msg])

    def process_msgs(self, msgs: list[BackendMsg]) -> list[TokenizerMsg]:
        self._mirror("msgs", msgs)
        return [reply for msg in msgs for reply in self._process(msg)]

    def _process(self, msg: BackendMsg) -> list[TokenizerMsg]:
        if isinstance(msg, UserMsg):
            error = self._admit(msg)
            if error:
                self.timeline.rejected(msg.uid, error.error.kind.value)
            else:
                self.timeline.queued(msg.uid, msg.sampling_params.n, len(msg.input_ids))
            return [error] if error else []
        if isinstance(msg, AbortBackendMsg):
            self.abort_req(msg.uid, msg.index)
            return []
        if isinstance(msg, StateQueryMsg):
            flushed = self.flush_cache() if msg.flush_cache else UNSET  # counted after it
            state = self.state()
            state.flushed_pages = flushed
            if self.tp.size > 1:  # every rank's own (and its process), on rank 0
                ranks = gather_objects(state.on_rank(self.tp.rank, os.getpid()))
                if self.tp.leader:
                    state.ranks = ranks
            return [SchedulerStateMsg(msg.query_id, state)]
        raise TypeError(f"scheduler cannot handle {type(msg).__name__}")

    # --8<-- [start:validate]
    def _admit(self, msg: UserMsg) -> BackendErrorMsg | None:
        ids, params = msg.input_ids, msg.sampling_params
        max_seq_len, vocab = self.engine.max_seq_len, self.engine.model_config.vocab_size
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
            eos_token_ids=self.eos_token_ids,
            forks_left=params.n - 1,  # the other choices fork off once the prompt is cached
            prompt_scores=PromptScores() if params.prompt_logprobs is not None else None,
        )
        if constrained:  # queued once its matcher is built, off this loop (llguidance)
            self._building[req.uid] = (req, self.grammars.build(msg.grammar))
        else:
            self.prefill_manager.add_req(req)
        return None

    # --8<-- [end:validate]

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        """A user's seed makes every choice reproducible; otherwise each gets a fresh one."""
        if params.seed is None:
            return self._seeds.getrandbits(63)
        return params.seed + index

    # --8<-- [start:fork]
    def _fork(self, first: Req) -> None:
        """The other choices of `first`'s request share the pages of its cached prompt.
        Each recomputes only the page that holds the prompt's last token (at most
        page_size tokens, into a page of its own: that position's output is what the
        choice samples its first token from), then decodes on its own."""
        shared = (first.prompt_len - 1) // self.cache_manager.page_size
        children = []
        for index in range(1, first.forks_left + 1):
            child = Req(
                uid=first.uid,
                token_ids=first.token_ids[: first.prompt_len],
                prompt_len=first.prompt_len,
                max_len=first.max_len,
                sampling_params=first.sampling_params,
                seed=self._seed_for(first.sampling_params, index),
                eos_token_ids=first.eos_token_ids,
                index=index,
                # the first choice's matcher has consumed nothing yet: its first token
                # is being sampled in the step that forks
                matcher=first.matcher and self.grammars.copy(first.matcher),
            )
            self.cache_manager.share(first, child, shared)
            child.cached_len = shared * self.cache_manager.page_size
            children.append(child)
        first.forks_left = 0
        self.prefill_manager.readmit(children)

    # --8<-- [end:fork]

    # --8<-- [start:abort_req]
    def abort_req(self, uid: int, index: int | None = None, how: str = "aborted") -> list[Req]:
        """Remove a request's sequences (one choice, or all) wherever they are (`how` it
        ended, for the timeline: "aborted", or "error")."""
        if uid in self._building:  # its matcher is still being built: it holds nothing
            req, _ = self._building.pop(uid)
            self.timeline.ended(req, how, sequences=1 + req.forks_left)
            return [req]
        reqs = self.prefill_manager.abort_req(uid, index)
        reqs += self.decode_manager.abort_req(uid, index)
        for req in reqs:
            # one choice stopped by a stop string, or all
            self.timeline.ended(req, how if index is None else "stop", 1 + req.forks_left)
            req.forks_left = 0  # an aborted first choice forks no others
            req.ended = True  # a token a launched step still makes for it is dropped
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

    def fail_all(self, error: ErrorInfo) -> list[TokenizerMsg]:
        """The scheduler cannot go on (its ranks fell out of step): an error reply for
        every request it holds. Their state stays: the process exits next."""
        uids = {r.uid for r in self.prefill_manager.pending}
        uids |= {uid for uid, _ in self.decode_manager.running}
        uids |= set(self._building)
        return [BackendErrorMsg(uid, error) for uid in sorted(uids)]

    def flush_cache(self) -> int:
        """Empty the prefix cache: the pages freed, or -1 (nothing done) while any request
        is in flight here."""
        if self.has_work:
            return -1
        return self.cache_manager.flush_cache()

    # ------------------------------------------------------------------ one step
    # --8<-- [start:step]
    def step(self) -> list[TokenizerMsg]:
        """One step, launched and read back (replies of a step still in flight first)."""
        built = self._built()
        self._mirror("step", built)
        return self._step(built)

    def _step(self, built: list[int] = ()) -> list[TokenizerMsg]:
        replies = self._admit_built(built) + self._take_in_flight()
        launched = self.launch_step()
        return replies + (self.finish_step(launched) if launched else [])

    def advance(self) -> list[TokenizerMsg]:
        """With overlap: launch the next step, then read the previous one. Else `step()`."""
        built = self._built()
        self._mirror("advance", built)
        return self._advance(built)

    def _advance(self, built: list[int] = ()) -> list[TokenizerMsg]:
        if not self.overlap:
            return self._step(built)
        replies = self._admit_built(built)
        launched = self.launch_step()
        replies += self._take_in_flight()
        self._in_flight = launched
        return replies

    def _built(self) -> list[int]:
        """The requests whose matcher is ready (rank 0 decides: the others wait for theirs)."""
        return [uid for uid, (_, future) in self._building.items() if future.done()]

    def _admit_built(self, uids: list[int]) -> list[TokenizerMsg]:
        """Queue the requests whose matcher is built; a grammar llguidance refused after all
        ends its request with an error."""
        errors: list[TokenizerMsg] = []
        for uid in uids:
            req, future = self._building.pop(uid)
            try:
                req.matcher = future.result()
            except GrammarError as e:
                field = _constraint_field(req.sampling_params)
                self.timeline.errored(uid, ErrorKind.INVALID_SAMPLING_VALUE.value)
                info = ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, str(e), field)
                errors.append(BackendErrorMsg(uid, info))
                continue
            self.prefill_manager.add_req(req)
        return errors

    def wait_for_matchers(self, timeout: float) -> None:
        """Idle but for matchers being built: sleep until one is ready (or `timeout`)."""
        futures = [future for _, future in self._building.values()]
        if futures:
            wait_for_futures(futures, timeout, return_when=FIRST_COMPLETED)

    def _take_in_flight(self) -> list[TokenizerMsg]:
        launched, self._in_flight = self._in_flight, None
        return self.finish_step(launched) if launched else []

    def launch_step(self) -> _Launched | None:
        """Schedule a batch and launch it; the sequences' host state moves on at once."""
        self.timeline.phase("schedule")
        batch = self._schedule_next_batch()
        self.timeline.phase("post")
        if batch is None:
            return None
        sampling = batch.sampling_reqs  # decided before cached_len moves
        self.steps += 1
        self.timeline.step(batch, self.steps)  # the step's start, before the forward pass
        started = time.perf_counter()
        handle = self.engine.launch(batch)
        self.timeline.phase("post")
        if self.engine.device.type == "cpu":  # the step has run: its time tells the speed
            prefill = sum(r.extend_len for r in batch.reqs[batch.decodes :])
            self.pacer.observe(prefill, batch.decodes, time.perf_counter() - started)
        scoring = [batch.reqs[i] for i, _, _, _ in batch.scoring]
        for req, (_, start, count, _) in zip(scoring, batch.scoring):
            req.prompt_scores.launched = start + count  # never scored twice, even if recomputed
        for req in batch.reqs[: batch.decodes]:  # one token each, sampled; already running
            req.cached_len += 1
            req.extend_len = 0
            req.num_pending += 1  # its token is on the device until finish_step
        for req in batch.reqs[batch.decodes :]:  # prefill chunks
            req.cached_len += req.extend_len
            req.extend_len = 0
            self.cache_manager.insert(req)  # its full pages are shared from the next step on
        for req in sampling[batch.decodes :]:  # prompts cached by this step: they decode
            req.num_pending += 1
            if req.forks_left:  # the request's other choices start from its pages
                self._fork(req)
            self.decode_manager.add_req(req)  # it left the prefill manager with this chunk
        # max_tokens 0: a prompt cached by this step with nothing to sample ends when the
        # step is read (its prompt logprobs with it); until then it waits with the running
        prefilled = [
            r for r in batch.reqs[batch.decodes :] if r.cached_len == r.seq_len >= r.max_len
        ]
        for req in prefilled:
            self.decode_manager.add_req(req)
        return _Launched(sampling, handle, sampling[batch.decodes :], scoring, prefilled)

    # --8<-- [start:finish_step]
    def finish_step(self, launched: _Launched) -> list[TokenizerMsg]:
        """Read a launched step's tokens: one reply per sequence that had not ended."""
        self.timeline.phase("sample")  # the wait for the step's tokens
        out = launched.handle.result()
        self.timeline.phase("post")
        for req, values in zip(launched.scoring, out.prompt_logprobs or [], strict=True):
            if not req.ended:
                req.prompt_scores.values += values
        logprobs = out.logprobs or [None] * len(out.tokens)
        replies: list[TokenizerMsg] = []
        for req, token, logprob in zip(launched.sampling, out.tokens, logprobs, strict=True):
            if req.ended:
                continue  # aborted or finished after this step was launched
            req.append_token(token)
            if req.matcher is not None:
                if (broken := advance(req.matcher, token, req.finish_reason == "stop")) is not None:
                    replies.append(self._constraint_broken(req, broken))
                    continue
            reply = DetokenizeMsg(req.uid, token, req.finish_reason, req.index, logprob)
            if req.cached_tokens:  # reported once, with its first token (for usage)
                reply.cached_tokens, req.cached_tokens = req.cached_tokens, 0
            if req.prompt_scores is not None:  # its first token: the prompt's logprobs go too
                reply.prompt_logprobs, req.prompt_scores = req.prompt_scores.values, None
            replies.append(reply)
            if req.finish_reason is not None:
                self._end(req)
        for req in launched.prefilled:
            if not req.ended:
                replies += self._end_prefilled(req)
        self.timeline.first_tokens(launched.first)  # sequences that sampled from their prompt
        return replies

    # --8<-- [end:finish_step]

    def _constraint_broken(self, req: Req, problem: str) -> BackendErrorMsg:
        """A constrained sequence that can no longer satisfy its constraint ends its whole
        request with an error: output reported as finished always parses."""
        field = _constraint_field(req.sampling_params)
        message = (
            f"{field}: the grammar library could not follow the constraint past output token "
            f"{req.output_len}: {problem}"
        )
        logger.info("uid %d: %s", req.uid, message)
        self.abort_req(req.uid, how="error")
        return BackendErrorMsg(req.uid, ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, message, field))

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
        req.ended = True
        # with the choices it never forked (max_tokens 0)
        self.timeline.ended(req, req.finish_reason or "stop", sequences=1 + req.forks_left)
        req.forks_left = 0
        self.cache_manager.insert(req)  # the next turn of a conversation starts with it
        if req.key in self.decode_manager.running:
            self.decode_manager.remove_req(req)
        else:  # preempted while its last token was pending
            self.prefill_manager.remove_req(req)
        self._free_req_resources(req)

    # --8<-- [end:end_sequence]

    def _schedule_next_batch(self) -> Batch | None:
        self._make_room_for_decode()
        decode, preempted = self.decode_manager.schedule_next(
            self.cache_manager, self._free_req_resources
        )
        if preempted:
            self.num_preemptions += len(preempted)
            self.timeline.preempted(preempted)
            logger.info("KV cache full: preempted %d request(s) for recompute", len(preempted))
            self.prefill_manager.readmit(preempted)
        prefill = self.prefill_manager.schedule_next(
            self.pacer.budget(len(decode)),
            self.table_manager,
            self.cache_manager,
            keep_free=len(decode),
        )
        reqs = decode + prefill
        self.cache_manager.flush()  # the page table rows of this step, on the device
        return Batch(reqs, decodes=len(decode)) if reqs else None

    # --8<-- [end:step]

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
                self._free_req_resources(req)

    # ------------------------------------------------------------------ process loop
    def run_forever(self, io: SchedulerIO) -> None:
        """Receive, step, send, for as long as `io.receive` returns: the process's I/O
        raises when the launcher is gone (io.py), and tests end the loop the same way."""
        while True:
            if not self._can_step:  # only matchers being built: wait for them, not spin
                self.wait_for_matchers(0.01)
            if not self.has_work:
                self.rest_followers()
            msgs = io.receive(blocking=not self.has_work)
            replies = self.process_msgs(msgs) if msgs else []
            replies += self.advance()
            if self.timeline.due(idle=not self.has_work):
                replies.append(self.timeline_batch())
            if replies:
                io.send(replies)

    def timeline_batch(self) -> TimelineMsg:
        """The timeline events since the last batch, with decode progress and KV pages."""
        cache = self.cache_manager
        running = list(self.decode_manager.running.values())
        return self.timeline.flush(running, (cache.used, cache.cached, cache.total))


def _constraint_field(params: SamplingParams) -> str:
    """The request field a constraint came from, as the HTTP API names it."""
    return "response_format" if params.json_schema is not None else "tools"


class _Launched:
    """A step launched on the device: who samples in it and the handle of its tokens."""

    __slots__ = ("sampling", "handle", "first", "scoring", "prefilled")

    def __init__(
        self,
        sampling: list[Req],
        handle: StepHandle,
        first: list[Req],
        scoring: list[Req],
        prefilled: list[Req],
    ) -> None:
        self.sampling, self.handle = sampling, handle
        self.first = first  # the sequences that sample from their prompt in this step
        self.scoring = scoring  # per entry of the batch's `scoring`: whose prompt it scores
        self.prefilled = prefilled  # max_tokens 0: prompts cached in this step, which end
