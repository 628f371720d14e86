"""Constrained requests in the scheduling policy: their grammar matchers, built off the step
loop and then fed every sampled token.

Contract: `Constrained(matchers)` takes what builds, copies and advances matchers
(engine/grammar.py's `Grammars`, handed over by the step loop), and holds the requests whose
matcher is being built (status BUILDING: they hold no slot or page yet).
- `start(req, grammar)` builds the request's matcher off the loop; `ready()` are the uids
  whose matcher is built (with several ranks, rank 0's list is what every rank admits: the
  step loop agrees on it), `wait(timeout)` sleeps until one is; `admit(uids)` takes them,
  each with its matcher set, or with the error that ends it (a grammar the library refused
  after all); `drop(uid)` forgets one that was aborted (its Req, or None).
- `copy(matcher)` is a fresh twin for another choice of the same request.
- `follow(req, token)` feeds a sampled token to the sequence's matcher; it returns the error
  that ends the request when its output can no longer satisfy the constraint (so output
  reported as finished always parses), else None.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for_futures
from typing import Any

from minisgl.core import Req, ReqStatus, SamplingParams
from minisgl.message import ErrorInfo, ErrorKind

logger = logging.getLogger(__name__)


class Constrained:
    def __init__(self, matchers: Any) -> None:
        self.matchers = matchers
        self.building: dict[int, tuple[Req, Future]] = {}  # uid -> (request, its matcher)

    def __len__(self) -> int:
        return len(self.building)

    def start(self, req: Req, grammar: str) -> None:
        req.status = ReqStatus.BUILDING
        self.building[req.uid] = (req, self.matchers.build(grammar))

    def ready(self) -> list[int]:
        return [uid for uid, (_, future) in self.building.items() if future.done()]

    def wait(self, timeout: float) -> None:
        futures = [future for _, future in self.building.values()]
        if futures:
            wait_for_futures(futures, timeout, return_when=FIRST_COMPLETED)

    def admit(self, uids: list[int]) -> list[tuple[Req, ErrorInfo | None]]:
        admitted = []
        for uid in uids:
            req, future = self.building.pop(uid)
            try:
                req.matcher = future.result()
            except ValueError as e:  # a grammar the grammar library refused after all
                field = _constraint_field(req.sampling_params)
                admitted.append((req, ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, str(e), field)))
            else:
                admitted.append((req, None))
        return admitted

    def drop(self, uid: int) -> Req | None:
        dropped = self.building.pop(uid, None)
        return dropped[0] if dropped is not None else None

    def copy(self, matcher: Any) -> Any:
        return self.matchers.copy(matcher)

    def follow(self, req: Req, token: int) -> ErrorInfo | None:
        problem = self.matchers.advance(req.matcher, token, req.finish_reason == "stop")
        if problem is None:
            return None
        field = _constraint_field(req.sampling_params)
        message = (
            f"{field}: the grammar library could not follow the constraint past output token "
            f"{req.output_len}: {problem}"
        )
        logger.info("uid %d: %s", req.uid, message)
        return ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, message, field)


def _constraint_field(params: SamplingParams) -> str:
    """The request field a constraint came from, as the HTTP API names it."""
    return "response_format" if params.json_schema is not None else "tools"
