"""SchedulerConfig: what the scheduler decides on its own, with its defaults explained.

Contract: no torch import (the API server process reads it through `ServerArgs`). The
engine's settings, `max_running_requests` among them (the engine sizes its page table and
CUDA graphs from it; the scheduler only reads it back), are `EngineConfig`'s.
(utils/flags.py's `split_options` sorts flat keyword options, as the command line and
`LLM(...)` take them, into the fields of the two configurations.)
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.utils.flags import option

PREFIX_CACHES = ("radix", "none")


@dataclass
class SchedulerConfig:
    # a longer prompt is prefilled in chunks. 8192 takes a typical prompt in one step while
    # bounding a step's activations and how long running decodes wait behind a prefill
    max_prefill_tokens: int = option(
        8192, "prefill token budget per step; longer prompts are prefilled in chunks", gt=0
    )
    # schedule step N+1 (and read step N's tokens) while the device runs step N. None:
    # on where the engine runs on CUDA; on a CPU a step runs while it is launched, so
    # overlap would only hold every token back by one step
    overlap_schedule: bool | None = option(
        None,
        "read each step's tokens before scheduling the next (overlap is on with CUDA)",
        name="--disable-overlap-schedule",
        negate=True,
    )
    # pacing.py: on a CPU a step of max_prefill_tokens is a minute, and every stream (and
    # every newcomer) would wait for it
    prefill_step_seconds: float | None = option(
        None,
        "size prefill chunks so one step takes about this long (three times it with nobody "
        "decoding and one prompt waiting; default: 0.3 on a CPU, off on CUDA; 0: off)",
        ge=0,
    )
    # "radix": requests that share a prefix share its KV pages (computed once, kept after
    # the request ends until the pages are needed); "none": every prompt from scratch
    prefix_cache: str = option(
        "radix",
        "radix: requests sharing a prefix share its KV pages; none: no reuse",
        choices=PREFIX_CACHES,
    )

    def __post_init__(self) -> None:
        if isinstance(self.prefix_cache, bool):  # LLM(prefix_cache=False) reads naturally
            self.prefix_cache = "radix" if self.prefix_cache else "none"
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHES)}")
