"""The three components of a request's life in one process, for quiz question 5.

`Pipeline` wires a frontend's two channels to the real `TokenizerWorker` (with a
one-character-per-token tokenizer, no model files) and a `CharScheduler` (the shared
`FakeScheduler`, tokens given as characters: the running uids, no model): every message the
frontend sends goes through the worker to the scheduler, and every token the test makes the scheduler sample comes back as a UserReply
in the frontend's inbox. `pipeline.worker_state()` and `pipeline.scheduler.running` are
what the tokenizer worker and the scheduler still hold, so a test can check all three
components after a run. `RefStyleTokenizerWorker` models the reference's worker, which
forwards an abort but keeps the uid's decode state.
"""

from __future__ import annotations

from minisgl.message import AbortMsg, FrontendMsg, TokenizerMsg
from minisgl.testing.fakes import FakeBackend, FakeScheduler
from minisgl.tokenizer.prepare import Preparation
from minisgl.tokenizer.server import TokenizerWorker


class CharTokenizer:
    """One token per character, the token id its code point: enough for the worker."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))

    def batch_decode(self, batch: list[list[int]], **kwargs) -> list[str]:
        return [self.decode(ids) for ids in batch]


class CharScheduler(FakeScheduler):
    """The shared fake scheduler, its tokens given as characters (CharTokenizer's ids are
    code points)."""

    def sample(self, *steps: tuple[int, str, bool]) -> int:
        return super().sample(*((uid, ord(char), last) for uid, char, last in steps))

    def late(self, uid: int, char: str) -> None:
        super().late(uid, ord(char))


class RefStyleTokenizerWorker(TokenizerWorker):
    """BROKEN ON PURPOSE, as the reference's worker: an AbortMsg goes on to the scheduler,
    but the uid's decode state stays, and no later message removes it."""

    def handle(self, msgs: list[TokenizerMsg]) -> None:
        decode_map = self.detokenize_manager.decode_map
        aborted = {m.uid: decode_map[m.uid] for m in msgs if isinstance(m, AbortMsg)}
        super().handle(msgs)
        decode_map.update(aborted)


class PipelineBackend(FakeBackend):
    """The frontend's channels: what it sends goes to the tokenizer worker as well."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: TokenizerWorker | None = None

    def send(self, msgs: list[TokenizerMsg]) -> None:
        super().send(msgs)
        self.worker.handle(msgs)


class Pipeline:
    def __init__(self, worker_cls: type[TokenizerWorker] = TokenizerWorker) -> None:
        self.backend = PipelineBackend()  # the frontend's side: send, recv
        self.scheduler = CharScheduler(self._to_worker)
        tokenizer = CharTokenizer()
        prepare = Preparation(tokenizer)
        self.worker = worker_cls(tokenizer, self.scheduler.handle, self._to_frontend, prepare)
        self.backend.worker = self.worker

    def _to_worker(self, msgs: list[TokenizerMsg]) -> None:
        self.worker.handle(msgs)

    def _to_frontend(self, msgs: list[FrontendMsg]) -> None:
        if msgs:
            self.backend.inject(*msgs)

    def worker_state(self) -> int:
        """Decode states the tokenizer worker holds."""
        return len(self.worker.detokenize_manager.decode_map)
