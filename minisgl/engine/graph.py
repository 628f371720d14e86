"""DecodeGraphRunner: decode steps replayed from CUDA graphs, one per batch-size bucket.

Why: a decode step of a small model is well under a millisecond of GPU work but hundreds of
kernel launches; launched from Python one by one, the host is the bottleneck. A CUDA graph
records the launches of one step once and replays them with a single call.

Contract: the runner knows the model, an attention backend that declares itself
`capturable` (its three capture hooks are all it uses of it) and the input builder's fixed
decode buffers. Every tensor the captured step reads lives in those buffers, sized for the
largest bucket, and the step's logits land in a fixed buffer too. `run(inputs)` takes
inputs the builder wrote into the buffers for a bucket (`StepInputBuilder.build(batch,
pad_to=bucket(len(batch.reqs)))`: rows past the real ones are dummy requests that write their K/V
to the pool's scratch page and read a one-token sequence from it), replays that bucket's
graph and returns the real rows' logits. Without capture (a CPU, or --disable-cuda-graph)
the same buffers run eagerly, which is how the padding is tested without a GPU.

The runner is built without graphs; `capture()` records them (the engine calls it after the
start-up self-check has passed the attention backend, and checks every bucket's replay
against the same step run eagerly: engine/selfcheck.py). Capture runs under
`torch.inference_mode()`, as every serving forward does (the engine's `launch`): a forward
recorded with autograd on would leave the logits buffer holding the history of every capture
forward, all their activations (tens of KiB per layer per row), for the process's life.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from minisgl.attention import AttentionBackend, AttentionContext
from minisgl.core import Batch
from minisgl.models.decoder import CausalLM
from minisgl.observe import RequestObserver

from .inputs import DecodeBuffers, StepInputs

logger = logging.getLogger(__name__)

BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        buffers: DecodeBuffers,
        vocab_size: int,
    ) -> None:
        assert backend.capturable, f"{type(backend).__name__} cannot be captured"
        self.model, self.backend, self.buffers = model, backend, buffers
        self.observer = RequestObserver()  # the engine's: marks the replay as the forward
        self.max_bs = buffers.input_ids.shape[0]
        self.buckets = [b for b in BUCKETS if b < self.max_bs] + [self.max_bs]
        dev = buffers.input_ids.device
        self.logits = torch.zeros(self.max_bs, vocab_size, dtype=torch.float32, device=dev)
        backend.init_capture(self.max_bs)
        self.metas: dict[int, Any] = {
            bs: backend.prepare_for_capture(buffers.info(bs)) for bs in self.buckets
        }
        self.steps = 0  # decode steps run through the fixed buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.records = dev.type == "cuda"  # whether capture() records graphs (CUDA only)

    def can_run(self, batch: Batch) -> bool:
        """One new token per request, each of which samples (a recomputed prompt's
        one-token chunk does not), and not more requests than the largest bucket."""
        return (
            len(batch.reqs) <= self.max_bs
            and batch.is_decode
            and len(batch.sampling_rows) == len(batch.reqs)  # read once, by the batch
        )

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # --8<-- [start:graph_forward]
    def _forward(self, bs: int) -> None:
        """One decode step over the first `bs` rows of the fixed buffers."""
        ctx = AttentionContext(self.backend, self.metas[bs])
        buf = self.buffers
        hidden = self.model(buf.input_ids[:bs], buf.positions[:bs], ctx)
        self.logits[:bs] = self.model.logits(hidden)

    # --8<-- [end:graph_forward]

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one CUDA graph per bucket; on a CPU there is nothing to record."""
        if not self.records:
            return
        pool = None
        stream = torch.cuda.Stream()
        # torch.cuda.graph makes its own side stream current and restores the caller's only
        # after capture_end: a step that raises mid-capture makes capture_end raise too, and
        # the side stream would stay current for every later step of this thread
        caller = torch.cuda.current_stream()
        try:
            for bs in reversed(self.buckets):  # largest first: the others reuse its memory
                stream.wait_stream(caller)
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile the Triton kernels, warm the allocator
                        self._forward(bs)
                caller.wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bs)
                pool = graph.pool()
                self.graphs[bs] = graph
        except BaseException:
            self.graphs.clear()  # no bucket replays a graph of a capture that failed
            raise
        finally:
            torch.cuda.set_stream(caller)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """(B, vocab) logits of the B real rows of a decode step built for a bucket."""
        bs = inputs.input_ids.shape[0]
        assert bs in self.metas, f"inputs of {bs} rows are not padded to a bucket"
        self.steps += 1
        return self.replay(bs)[: inputs.num_reqs]

    def replay(self, bs: int) -> torch.Tensor:
        """(bs, vocab) logits of the step the buffers' first `bs` rows hold (eagerly when
        no graph was captured)."""
        self.backend.prepare_for_replay(self.buffers.info(bs), self.metas[bs])
        self.observer.phase("forward")
        if bs in self.graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.logits[:bs]
