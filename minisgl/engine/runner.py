"""StepRunner: one step's forward pass, on the fastest path this machine has.

Contract: `run(batch)` builds the step's inputs and runs the model: (inputs, (S, vocab)
float32 logits of the S requests that sample, None where none does, the prompt logprobs
the batch asks for: scoring.py). Which path a step takes was chosen when the engine was
built (engine/build.py):
- a decode batch that a captured CUDA graph fits is replayed (the engine's graph runner);
- on a CPU, a batch of decodes runs in one C call where `native` (models/native.py) was
  built and vetted; it reads the same KV pages and gives the same tokens;
- every other step runs the model in torch;
- on a CPU, `threads` (threads.py) runs each step on the torch thread count measured
  fastest for steps of its size.
(The third CPU speed-up, half of a large matmul on a helper thread, is the int4 weights'
own: the loader gives them the helper where a second core is free, utils/split.py.)
The runner marks where a step's time starts to count toward "prepare" and "forward" in
the engine's observer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.attention import AttentionContext
from minisgl.core import Batch

from .inputs import StepInputs
from .scoring import DevicePromptScores, score_prompts

if TYPE_CHECKING:
    from minisgl.models.native import NativeDecoder

    from .engine import Engine
    from .threads import ThreadChoice

Forward = tuple[StepInputs, torch.Tensor | None, DevicePromptScores | None]


class StepRunner:
    def __init__(
        self,
        engine: Engine,
        native: NativeDecoder | None = None,
        threads: ThreadChoice | None = None,
    ) -> None:
        self.engine = engine
        self.native = native
        self.threads = threads

    def run(self, batch: Batch) -> Forward:
        if self.threads is None:
            return self._forward(batch)
        with self.threads.step(sum(r.extend_len for r in batch.reqs)):
            return self._forward(batch)

    def _forward(self, batch: Batch) -> Forward:
        engine = self.engine
        graphs = engine.graph_runner  # None once the self-check fell back from it
        engine.observer.phase("prepare")
        if graphs is not None and not batch.scoring and graphs.can_run(batch):
            inputs = engine.inputs.build(batch, pad_to=graphs.bucket(len(batch.reqs)))
            return inputs, graphs.run(inputs), None  # its replay marks the forward
        inputs, scores = engine.inputs.build(batch), None
        if self.native is not None and self.native.takes(batch):  # decodes: one C call
            engine.observer.phase("forward")
            hidden = self.native.forward(inputs.input_ids, inputs.info)  # (B, hidden)
            head = self.native.logits
        else:
            backend = engine.attn_backend
            ctx = AttentionContext(backend, backend.prepare(inputs.info))
            engine.observer.phase("forward")
            hidden = engine.model(inputs.input_ids, inputs.info.positions, ctx)  # (T, hidden)
            if batch.scoring:  # prompt logprobs: from rows of the chunk that are dropped next
                scores = score_prompts(engine.model, hidden, batch, engine.inputs.staging)
            head = engine.model.logits
        if not batch.sampling_reqs:  # chunks inside their prompts: no row needs the LM head
            return inputs, None, scores  # (it would have run on every row of the chunk)
        if inputs.sample_rows is not None:  # the last token of each request that samples
            hidden = hidden[inputs.sample_rows]
        return inputs, head(hidden), scores
