"""Fault injection into the CUDA fast path: the test-side seam the self-check's tests drive
(production never imports this module).

Contract: `MINISGL_INJECT_FAULTS` names faults, comma-separated; `install()` wraps the
engine's start-up vetting (`minisgl.engine.build.vet`) so that `inject(engine)` breaks the
named parts of each freshly built engine of this process before its self-check runs (with
a pytest `monkeypatch`, only for the test). A process a test starts gets the faults too
when its PYTHONPATH holds tests/fault_site/ (`site_env()`): its sitecustomize.py installs
them at start-up. Nothing happens when the variable is unset. The faults are put into the
components themselves, not into the check, and stay there while the engine serves: a test
that sees correct tokens afterwards proves the fallback really routes around the broken
part.

- `triton-values`: the Triton backend's attention returns wrong values (each query head's
  output is the next head's, as a wrong head offset in a kernel would give).
- `triton-compile`: the Triton backend raises on every call, as when the compiler refuses
  a kernel.
- `graph-capture`: capturing the decode CUDA graphs raises, as a capture that allocates or
  syncs does (on a CPU nothing is captured, but the capture step still runs and raises).
- `overlap`: a step's sampled tokens never reach the buffer the next step reads pending
  tokens from, as a stream-ordering bug would leave it: an overlapped step reads stale
  tokens, a synchronous one (which knows its tokens on the host) is unaffected.

A name may end in `@RANK` (`overlap@1`): the fault is then injected on that tensor-parallel
rank only, which is how the tests see one rank's failure become every rank's fallback.

Only meaningful with the self-check running: on a CPU set `MINISGL_SELF_CHECK_ON_CPU=1`
too (engine/selfcheck.py), which runs the same check code there, the Triton kernels in
Triton's interpreter.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

SITE = Path(__file__).with_name("fault_site")  # its sitecustomize.py installs the faults

ENV = "MINISGL_INJECT_FAULTS"
FAULTS = ("triton-values", "triton-compile", "graph-capture", "overlap")


class InjectedFault(RuntimeError):
    """An error a fault injected through MINISGL_INJECT_FAULTS raises."""


def requested(rank: int = 0) -> list[str]:
    """The faults MINISGL_INJECT_FAULTS names for tensor-parallel rank `rank`."""
    names = []
    for item in filter(None, (n.strip() for n in os.environ.get(ENV, "").split(","))):
        name, _, on_rank = item.partition("@")
        if name not in FAULTS or (on_rank and not on_rank.isdigit()):
            raise ValueError(f"{ENV}: unknown fault {item!r}; known: {', '.join(FAULTS)}, "
                             "each optionally @RANK")  # fmt: skip
        if not on_rank or int(on_rank) == rank:
            names.append(name)
    return names


def inject(engine) -> list[str]:
    """Break the parts of `engine` that MINISGL_INJECT_FAULTS names; returns the names."""
    names = requested(engine.tp.rank)
    backend = engine.attn_backend
    triton = type(backend).__name__ == "TritonBackend"
    if "triton-values" in names and triton:
        real = backend.attention

        def wrong_values(self, layer_id, q, k, v, meta):
            return real(layer_id, q, k, v, meta).roll(1, dims=1)  # (T, H, D): heads shifted

        backend.attention = types.MethodType(wrong_values, backend)
    if "triton-compile" in names and triton:

        def refuse(self, *args, **kwargs):
            raise InjectedFault(
                f"{ENV}=triton-compile: triton.compiler.errors.CompilationError "
                "(the compiler refused the kernel)"
            )

        backend.attention = types.MethodType(refuse, backend)
    if "graph-capture" in names and engine.graph_runner is not None:

        def fail_capture(self):
            raise InjectedFault(
                f"{ENV}=graph-capture: CUDA error: operation not permitted when stream is capturing"
            )

        engine.graph_runner.capture = types.MethodType(fail_capture, engine.graph_runner)
    if "overlap" in names:
        engine.inputs.record_sampled = lambda inputs, tokens: None
    return names


def install(monkeypatch=None) -> None:
    """Inject the faults MINISGL_INJECT_FAULTS names into every engine this process builds
    from now on (undone with the test, given its `monkeypatch`)."""
    from minisgl.engine import build

    vet = build.vet

    def vet_with_faults(engine) -> None:
        inject(engine)
        vet(engine)

    if monkeypatch is not None:
        monkeypatch.setattr(build, "vet", vet_with_faults)
    else:
        build.vet = vet_with_faults


def site_env(names: str) -> dict[str, str]:
    """The environment of a process that builds its engines with these faults."""
    path = os.pathsep.join([str(SITE), str(SITE.parent), os.environ.get("PYTHONPATH", "")])
    return {ENV: names, "PYTHONPATH": path.rstrip(os.pathsep)}
