"""How many threads a CPU step computes on: chosen step by step, by measuring both.

Contract:
- `ThreadChoice.for_cpu(device, ranks)` is None where there is nothing to choose: a GPU, a
  tensor-parallel rank (the ranks share the cores among themselves), OMP_NUM_THREADS set
  (the user's count is kept), or too few cores for two counts. Otherwise it starts torch
  on the narrow count and returns the chooser.
- `with choice.step(tokens):` runs one step of `tokens` tokens on the count chosen for
  steps of that size and records how long it took. Steps are grouped by size (tokens in
  powers of two: a batch of 16 decodes, a 158-token prefill); each group chooses alone.
- The two counts: narrow leaves two cores to the API server and the tokenizer worker
  (cores - 2, at least 1: `share_cpu_cores` below); wide takes every core.

Why choose at run time: on an idle machine the wide count is faster, but torch's threads
spin-wait on each other at every parallel operator, and while another process holds one of
the cores the wide count is many times slower (benchmarks/RESULTS.md, "Why the CPU path is
shaped as it is"). Which one wins depends on what else runs, which only the step's own
time shows. So each group of steps first runs
a couple of steps with each count, keeps the faster (each count judged by its fastest step:
the first after a pause may wake sleeping threads), and retries the other now and then:
every PROBE_EVERY steps while the wide count leads (its failure is the costly one), and
at doubling intervals up to MAX_EVERY while the narrow count leads (its worst case is the
narrow time itself). PROBE_STEPS leading steps in a row that take SLOWDOWN times the
leader's recent median (a neighbour just started; one slow step alone is noise) retry the
other at once, the leader judged by those steps, and a retried count's step that
takes SLOWDOWN times the leader's ends the retry there.

The count is torch's own (`torch.set_num_threads`, the calling thread's OpenMP count),
so an offline `LLM` changes it in its caller's process; OMP_NUM_THREADS keeps a count of
one's own. The embedded model's greedy tokens and logprobs are bit for bit the same on
either count, a batch of three and a single request (tests/unit/test_threads.py): the
kernels those steps run divide their work by output rows and columns, not along a sum.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from minisgl.utils.process import usable_cores

PROBE_EVERY = 32  # steps between retries of the other count while the wide one leads
MAX_EVERY = 1024  # the longest interval while the narrow one leads
PROBE_STEPS = 2  # steps a retry runs (the first may wake sleeping threads)
SLOWDOWN = 2.0  # a leader's step this many times its recent median: retry now
WINDOW = 5  # recent step times kept per count


def narrow_threads(cores: int) -> int:
    """Threads that leave two cores to the server's other processes."""
    return max(1, cores - 2)


class _Group:
    """The choice for one size of step: both counts' recent times, the leader, when to
    retry the other."""

    def __init__(self, narrow: int, wide: int) -> None:
        self.counts = (narrow, wide)
        self.times: dict[int, deque[float]] = {n: deque(maxlen=WINDOW) for n in self.counts}
        self.leader = narrow
        self.every = PROBE_EVERY
        self.countdown = 0  # steps until the next retry
        self.retry: int | None = None  # the count being retried
        self.retry_left = 0
        self.measured = False  # both counts' first PROBE_STEPS steps run
        self.slow: list[float] | None = None  # the leader's steps that set off this retry
        self.slow_steps: list[float] = []  # the leader's slow steps in a row

    def _other(self) -> int:
        return self.counts[1] if self.leader == self.counts[0] else self.counts[0]

    def pick(self) -> int:
        if not self.measured:  # first, PROBE_STEPS steps of each
            return next(n for n in self.counts if len(self.times[n]) < PROBE_STEPS)
        if self.retry is not None:
            return self.retry
        if self.countdown <= 0:
            self.retry, self.retry_left = self._other(), PROBE_STEPS
            self.times[self.retry].clear()  # its old times may be from another machine load
            return self.retry
        self.countdown -= 1
        return self.leader

    def record(self, n: int, seconds: float) -> None:
        times = self.times[n]
        if self.retry is None and n == self.leader and len(times) == WINDOW:
            if seconds <= SLOWDOWN * statistics.median(times):
                self.slow_steps.clear()
            else:  # not counted in the window: a slow step is judged apart
                self.slow_steps.append(seconds)
                if len(self.slow_steps) == PROBE_STEPS:  # the leader slowed down: retry
                    self.countdown, self.slow = 0, list(self.slow_steps)  # the other now
                    self.slow_steps.clear()
                return
        times.append(seconds)
        if not self.measured:
            if all(len(self.times[c]) >= PROBE_STEPS for c in self.counts):
                self.measured = True  # the first measurements of both are in
                self._decide(self.counts[1], min(self.times[self.leader]))
            return
        if self.retry is None or n != self.retry:
            return
        self.retry_left -= 1
        leader = min(self.slow) if self.slow is not None else self._recent(self.leader)
        if self.retry_left == 0 or seconds > SLOWDOWN * leader:  # far slower: ends early
            self._decide(self.retry, leader)

    def _recent(self, n: int) -> float:
        """The median of count n's last three steps."""
        return statistics.median(list(self.times[n])[-3:])

    def _decide(self, challenger: int, leader_s: float) -> None:
        """The challenger is judged by its fastest step (the first of a retry may wake
        sleeping threads), the leader by `leader_s`."""
        if min(self.times[challenger]) < leader_s:
            self.leader, self.every = challenger, PROBE_EVERY
        elif self.leader == self.counts[0]:  # narrow leads again: back off
            self.every = min(2 * self.every, MAX_EVERY)
        else:
            self.every = PROBE_EVERY
        if self.slow is not None and self.leader != challenger:  # slower, still the faster:
            self.times[self.leader].clear()  # its slow steps are its times from now on
            self.times[self.leader].extend(self.slow)
        self.retry, self.countdown, self.slow = None, self.every, None


class ThreadChoice:
    """Chooses, per size of step, between a narrow and a wide torch thread count."""

    def __init__(
        self,
        narrow: int,
        wide: int,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.narrow, self.wide = narrow, wide
        self._set, self._clock = set_threads, clock
        self._groups: dict[int, _Group] = {}
        self.current = narrow
        set_threads(narrow)

    @classmethod
    def for_cpu(cls, device: torch.device, ranks: int = 1) -> ThreadChoice | None:
        cores = usable_cores()
        if device.type != "cpu" or ranks > 1 or "OMP_NUM_THREADS" in os.environ:
            return None
        if narrow_threads(cores) == cores:
            return None
        torch.set_num_threads(cores)  # start the wide count's threads now, not in a step
        torch.ones(1 << 20).sum()
        return cls(narrow_threads(cores), cores)

    def leader(self, tokens: int) -> int | None:
        """The count leading for steps of `tokens` tokens (None: none measured yet)."""
        group = self._groups.get(tokens.bit_length())
        return None if group is None else group.leader

    @contextmanager
    def step(self, tokens: int) -> Iterator[int]:
        group = self._groups.get(tokens.bit_length())
        if group is None:
            group = self._groups[tokens.bit_length()] = _Group(self.narrow, self.wide)
        n = group.pick()
        if n != self.current:
            self._set(n)
            self.current = n
        start = self._clock()
        yield n
        group.record(n, self._clock() - start)


def share_cpu_cores(device: str) -> None:
    """On a CPU the API server and the tokenizer worker need cores too: torch's compute
    threads spin-wait on each other, and one descheduled thread stalls them all (a stream
    many times slower: benchmarks/RESULTS.md). Leave two cores to the other processes.
    This is where a process starts; a single-rank engine then widens a step to every core
    where that measures faster (`ThreadChoice` above)."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(narrow_threads(usable_cores()))
