"""Building an engine: load it, vet its fast paths, and return it ready to serve.

Contract: `build_engine(config)` is how every process gets an engine (the scheduler, a
tensor-parallel rank, the offline `LLM`, doctor, the benchmarks):
1. on a CPU, the thread chooser (threads.py) starts before the load, which gives the int4
   weights a helper thread where torch computes on one;
2. `Engine(config)` loads the weights, sizes the KV pool and allocates;
3. on a CPU (unless `native_decode` is off), the native decode step (models/native.py) is
   built and vetted against torch's: where it cannot be built, decode steps run on torch;
   where it disagrees, too, and `engine.degraded` says why; where it agrees, a short race
   on the model's shapes (race.py) keeps whichever of the two is faster here;
4. `vet(engine)`: the start-up self-check of the CUDA fast path (selfcheck.py), which falls
   back where a part fails and records it in `engine.degraded`; it stays on the engine
   (`engine.self_check`), which the scheduler asks before it overlaps steps;
5. one log line says what was built, and what it fell back from.
The engine's `runner` (runner.py) is then the path each step takes.
"""

from __future__ import annotations

import logging

from minisgl.models.native import NativeDecoder

from .config import EngineConfig
from .engine import Engine
from .race import race_decode
from .runner import StepRunner
from .selfcheck import SelfCheck
from .threads import ThreadChoice

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> Engine:
    from minisgl.distributed import tp

    threads = ThreadChoice.for_cpu(config.resolve_device(), tp().size)
    engine = Engine(config)
    engine.runner = StepRunner(engine, _native_decoder(engine), threads)
    vet(engine)
    logger.info(
        "engine ready: %s on %s (%s, weights: %s)%s, %d KV pages of %d tokens, "
        "max_seq_len %d, %s%s",
        engine.model_dir.name,
        engine.device,
        engine.dtype,
        engine.quantization,
        f", rank {engine.tp.rank} of {engine.tp.size}" if engine.tp.size > 1 else "",
        engine.num_pages,
        engine.page_size,
        engine.max_seq_len,
        type(engine.attn_backend).__name__,
        ", CUDA graphs" if engine.graph_runner is not None and engine.graph_runner.graphs else "",
    )
    if summary := engine.self_check.summary():
        logger.info("%s", summary)
    return engine


def vet(engine: Engine) -> None:
    """The start-up self-check: attention, then the decode graphs' capture and replays."""
    engine.self_check = SelfCheck(engine)
    engine.self_check.at_startup()


def _native_decoder(engine: Engine) -> NativeDecoder | None:
    """A vetted native decode step for a CPU engine that is faster than torch's here, or
    None (decode steps run on torch)."""
    if engine.device.type != "cpu" or not engine.config.native_decode:
        return None
    native, why = NativeDecoder.build(engine.model, engine.pool, engine.config.max_running_requests)
    if why is not None:
        logger.info("decode steps run on torch: %s", why)
        return None
    if (why := native.disagreement()) is not None:
        engine.degraded["native decode"] = why
        logger.warning("decode steps fall back to torch: %s", why)
        return None
    winner, line = race_decode(engine, native)
    if winner != "native":
        logger.info("decode steps run on torch: %s", line)
        return None
    logger.info("decode steps run natively (%s kernel): %s", native.kernel, line)
    return native
