"""A decode step in one native call: the whole model for the step's tokens, in C.

Contract:
- `NativeDecoder.build(model, pool, max_batch)` returns `(decoder, None)`, or `(None,
  reason)` where this model, machine or pool cannot take the native path (no C compiler,
  weights that are not all int4-packed, tensor parallelism, a KV pool that is not float32
  on the CPU, a torch whose int4 packing is not blocked by rows...). Nothing else changes
  in that case: the torch path runs every step, as it does every step the native one does
  not take (`decoder.takes(batch)`: decode tokens only, no prompt logprobs, at most
  `decoder.max_batch`, MAX_BATCH or fewer).
- `decoder.forward(input_ids, info)` runs one decode token of each of the step's B
  requests (its `ForwardInfo`): it stores the tokens' K/V in every layer of `pool` and
  returns the final hidden states (B, hidden), as `CausalLM.forward` would.
  `decoder.logits(hidden)` returns the LM head's (R, vocab) float32 logits of R rows.
- The weights are read where torch keeps them (`Int4Linear.packed`, `.scale_zeros`): the
  decoder owns only a few rows of scratch per token.
- A token's results are the same alone or in a batch, on any thread count: every output is
  summed in an order fixed by the shapes (native_gemv.h, native_attention.h).

Why: a batch-1 step of the embedded 30-layer model is about 2,000 torch operators, whose
dispatch and Python cost most of a small step, more than its arithmetic (the figures are in
benchmarks/RESULTS.md). In C the same step is one call; the
weights are still streamed once, as they must be, and in a batch each block of them is
read from memory once for all the tokens. What a step costs then is the weights' bytes,
the arithmetic on them, and the attention over each context: the matrix-vector kernel
takes four inputs per instruction where the CPU has AVX-512 VBMI and VNNI, and the
attention reads each key and value row once for every head (native_gemv.h,
native_attention.h).

Numerics: activations stay float32 between the projections (norms, RoPE, attention, the
residual stream, the logits). Inside a projection, the AVX-512 kernels round the input to
15-bit integers per group of 32 (each within 1/32766 of its group's largest value) for
exact integer dot products; the torch path rounds every projection's input and output to
bf16 (within 1/256 of each value). So the native logits are no further from the float32
model's than the torch path's (tests/unit/test_native.py).

The C source (native_decode.c and the two headers it includes, beside this file) is
compiled on first use with the machine's C compiler (`CC`, else `cc`; `-O3 -march=native
-fopenmp`) into the user's cache folder, keyed by the sources, the flags and the CPU, and
loaded with ctypes; `decoder.kernel` names the matrix-vector kernel that build chose.
OpenMP resolves to the runtime torch has loaded already (the same soname), so both share
one pool of threads and torch's thread count. Where the compiler refuses `-fopenmp`
(Apple's clang) the same source is built without it, on one thread, and one warning says
how to get every core; the engine's start-up race (engine/race.py) then keeps it only
where it still beats torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from .quant import _LAYOUT, BLOCK_N, GROUP, Int4Linear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_decode.c")
HEADERS = [SOURCE.with_name(name) for name in ("native_gemv.h", "native_attention.h")]
# no errno or floating-point traps to keep: libm's calls become instructions, and loops
# with a branch (the exponentials' range, the sigmoid's two sides) vectorize
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC", "-std=gnu11"]  # fmt: skip
if platform.machine() in ("x86_64", "AMD64"):
    FLAGS.append("-mprefer-vector-width=512")  # AVX-512 where the CPU has it
# where the compiler refuses OpenMP (Apple's clang): the same code on one thread (its
# `#pragma omp` lines are then ignored; it calls no OpenMP function)
SERIAL_FLAGS = [flag for flag in FLAGS if flag != "-fopenmp"]


class _Weight(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("sz", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int32),
        ("n_pad", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("kp", ctypes.c_int32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int32)
        for name in (
            "num_layers",
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "inter",
            "page_size",
            "block",
            "max_batch",
        )  # fmt: skip
    ] + [
        ("eps", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("slots", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("work", ctypes.c_void_p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("x", "pos", "slot", "pages", "seq_len")),
        ("batch", ctypes.c_int32),
        ("page_stride", ctypes.c_int32),
    ]


_library: ctypes.CDLL | str | None = None  # the loaded library, or why there is none


def library() -> ctypes.CDLL | str:
    """The compiled native_decode.c (built once per machine), or the reason it is not."""
    global _library
    if _library is None:
        try:
            _library = _load(_compile())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _library = _without_openmp(e)
    return _library


def _without_openmp(failed: Exception) -> ctypes.CDLL | str:
    """The library built on one thread where the OpenMP build failed (and only OpenMP was
    missing: this build succeeds), said in one line; else why there is none."""
    try:
        lib = _load(_compile(SERIAL_FLAGS))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return f"native decode unavailable: {failed}"
    cc = os.environ.get("CC", "cc")
    if platform.system() == "Darwin":
        how = (
            "Apple's clang has no OpenMP; for every core set CC to a compiler with it, e.g. "
            "Homebrew's llvm (brew install llvm libomp; CC=$(brew --prefix llvm)/bin/clang)"
        )
    else:
        how = f"{cc} cannot build with -fopenmp; install its OpenMP runtime for every core"
    logger.warning("native decode step built without OpenMP, on one thread: %s", how)
    return lib


def _cpu_key() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("flags", "Features"))
        )  # fmt: skip
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _compile(flags: list[str] = FLAGS) -> Path:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} is not on PATH)")
    sources = [path.read_bytes() for path in (SOURCE, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join([cc, *flags]).encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minisgl"
    target = cache / f"native_decode-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # compile beside the target, then rename: processes starting at once never load half
    # a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.minisgl_decode.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    lib.minisgl_decode.restype = None
    lib.minisgl_gemm.argtypes = [
        ctypes.POINTER(_Weight), ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32
    ]  # fmt: skip
    lib.minisgl_gemm.restype = ctypes.c_int32
    lib.minisgl_work_floats.argtypes = [ctypes.POINTER(_Model)]
    lib.minisgl_work_floats.restype = ctypes.c_int64
    lib.minisgl_gemv_kernel.argtypes = []
    lib.minisgl_gemv_kernel.restype = ctypes.c_char_p
    return lib


def kernel_name(lib: ctypes.CDLL) -> str:
    """Which matrix-vector kernel `lib` was built with: "quads" or "pairs" (AVX-512, x in
    15-bit integers), "avx2" or "plain" (float32); native_gemv.h says what each does."""
    return lib.minisgl_gemv_kernel().decode()


MAX_BATCH = 64  # the most decode tokens a native step takes (its scratch is sized for them)


class NativeDecoder:
    def __init__(
        self, lib: ctypes.CDLL, model: nn.Module, pool, block: int, max_batch: int = MAX_BATCH
    ) -> None:
        self.lib, self.model, self.block, self.max_batch = lib, model, block, max_batch
        self.kernel = kernel_name(lib)
        c, inner = model.config, model.model
        self._keep: list[torch.Tensor] = []  # tensors whose pointers the structs hold
        layers = (_Layer * c.num_layers)()
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers[i] = _Layer(
                self._f32(layer.input_layernorm.weight),
                self._f32(layer.post_attention_layernorm.weight),
                self._f32(attn.q_norm.weight) if attn.qk_norm else None,
                self._f32(attn.k_norm.weight) if attn.qk_norm else None,
                self._weight(attn.qkv_proj),
                self._weight(attn.o_proj),
                self._weight(mlp.gate_up_proj),
                self._weight(mlp.down_proj),
            )
        self._layers = layers
        rotary = inner.rotary
        self._model = _Model(
            c.num_layers, c.hidden_size, model.num_heads, model.num_kv_heads, c.head_dim,
            c.intermediate_size, pool.page_size, block, max_batch, c.rms_norm_eps, layers,
            self._f32(inner.norm.weight), pool.k.data_ptr(), pool.v.data_ptr(),
            pool.k.shape[1], self._f32(rotary.cos), self._f32(rotary.sin), None,
        )  # fmt: skip
        self.work = torch.empty(lib.minisgl_work_floats(ctypes.byref(self._model)))
        self._model.work = self.work.data_ptr()
        self.lm_head = self._weight(model.lm_head)
        self.hidden = torch.empty(max_batch, c.hidden_size)
        self._step = _Step()
        self._step_ref, self._model_ref = ctypes.byref(self._step), ctypes.byref(self._model)

    def _f32(self, t: torch.Tensor) -> int:
        t = t.detach().contiguous().float()
        self._keep.append(t)
        return t.data_ptr()

    def _weight(self, lin: Int4Linear) -> _Weight:
        w, keep = weight_struct(lin)
        self._keep += keep
        return w

    @classmethod
    def build(
        cls, model: nn.Module, pool, max_batch: int = MAX_BATCH
    ) -> tuple[NativeDecoder | None, str | None]:
        """The decoder for steps of up to `max_batch` decode tokens, or None and why this
        model or machine takes the torch path."""
        why = _unsupported(model, pool)
        if why is None:
            block, paired = _LAYOUT._find()
            if paired or block not in (32, 64) or BLOCK_N % block:
                why = f"torch packs int4 codes in pairs of rows (block {block}), not supported"
        if why is not None:
            return None, why
        lib = library()
        if isinstance(lib, str):
            return None, lib
        return cls(lib, model, pool, block, min(max_batch, MAX_BATCH)), None

    def disagreement(self) -> str | None:
        """The start-up check: the native kernel against torch's on the first layer's q/k/v
        projection and the LM head, for one random row. None when they agree within 2 % of
        the largest output (the torch kernel rounds to bf16: well under 1 %); else why not.
        A compiler or CPU that builds a wrong kernel makes the engine fall back."""
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(self.model.config.hidden_size, generator=gen)
        for lin in (self.model.model.layers[0].self_attn.qkv_proj, self.model.lm_head):
            want = lin(x[None])[0]
            err = (matmul(lin, x, self.lib, self.block) - want).abs().max().item()
            if not err <= 0.02 * want.abs().max().item():  # NaN fails too
                return (
                    f"the native kernel disagrees with torch's on {lin.extra_repr()}: "
                    f"largest difference {err:.3g}, largest output {want.abs().max():.3g}"
                )
        return None

    def takes(self, batch) -> bool:
        """Whether the step of `batch` runs natively: decode tokens only (one each), no
        prompt logprobs, at most `max_batch` of them."""
        return batch.is_decode and not batch.scoring and len(batch.reqs) <= self.max_batch

    def forward(self, input_ids: torch.Tensor, info) -> torch.Tensor:
        """One decode token of each of B requests (the step's `ForwardInfo`): (B,) ids ->
        (B, hidden) final hidden states."""
        B = input_ids.shape[0]
        assert B <= self.max_batch, f"{B} tokens: the native step takes {self.max_batch}"
        x = self.hidden[:B]
        x.copy_(self.model.model.embed_tokens(input_ids))
        pages = info.block_table.contiguous()
        inputs = (info.positions, info.out_slots, info.seq_lens)
        assert all(t.is_contiguous() for t in inputs)
        s = self._step
        s.x, s.pos, s.slot = x.data_ptr(), info.positions.data_ptr(), info.out_slots.data_ptr()
        s.pages, s.seq_len = pages.data_ptr(), info.seq_lens.data_ptr()
        s.batch, s.page_stride = B, pages.shape[1]
        self.lib.minisgl_decode(self._model_ref, self._step_ref)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, vocab) float32, from the LM head's packed weights."""
        hidden = hidden.contiguous()
        out = torch.empty(hidden.shape[0], self.lm_head.n)
        _gemm(self.lib, self.lm_head, hidden, out, self.block)
        return out[:, : self.model.config.vocab_size]


def _gemm(lib: ctypes.CDLL, w: _Weight, x: torch.Tensor, out: torch.Tensor, block: int) -> None:
    if lib.minisgl_gemm(ctypes.byref(w), x.data_ptr(), x.shape[0], out.data_ptr(), block):
        raise MemoryError(f"no memory for the native kernel's scratch ({x.shape[0]} rows)")


def weight_struct(lin: Int4Linear) -> tuple[_Weight, list[torch.Tensor]]:
    """The C view of `lin`'s packed weight, and the tensors it points into."""
    packed, sz = lin.packed, lin.scale_zeros
    keep = [packed, sz]
    bias = None
    if lin.bias is not None:
        keep.append(lin.bias.detach().float().contiguous())
        bias = keep[-1].data_ptr()
    w = _Weight(
        packed.data_ptr(), sz.data_ptr(), bias, lin.out_features, packed.shape[0],
        lin.in_features, sz.shape[0] * GROUP,
    )  # fmt: skip
    return w, keep


def matmul(lin, x: torch.Tensor, lib: ctypes.CDLL | None = None, block: int | None = None):
    """x (K,) or (M, K) -> x @ w.T (+ bias), (N,) or (M, N) float32, by the native kernel
    (tests, benchmarks, the start-up check). `lin`: an `Int4Linear`, or anything with its
    packed buffers laid out in `block`s of rows (default: torch's own block); `lib`: another
    build of the library."""
    lib = lib or library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    w, _keep = weight_struct(lin)
    rows = x.float().reshape(-1, lin.in_features).contiguous()
    y = torch.empty(rows.shape[0], lin.out_features)
    _gemm(lib, w, rows, y, block or _LAYOUT._find()[0])
    return y.view(*x.shape[:-1], lin.out_features)


def _unsupported(model: nn.Module, pool) -> str | None:
    """Why `model` and `pool` cannot run natively, or None."""
    if getattr(model, "tp", None) is not None and model.tp.size > 1:
        return "tensor parallelism"
    if pool.k.device.type != "cpu" or pool.k.dtype != torch.float32:
        return "the KV pool is not float32 on the CPU"
    inner = model.model
    for layer in inner.layers:
        for lin in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):  # fmt: skip
            if not isinstance(lin, Int4Linear):
                return f"{type(lin).__name__} weights (the native path reads int4-packed ones)"
    if not isinstance(model.lm_head, Int4Linear):
        return f"a {type(model.lm_head).__name__} LM head"
    if not pool.k.is_contiguous() or not pool.v.is_contiguous():
        return "a KV pool that is not contiguous"
    return None
