"""Checking an attention backend on its own pool against attention written out plainly.

Contract: `check_attention(backend, ...)` runs `backend` (with the pool and layer 0 it was
built over) on random paged steps and returns three `CheckResult`s: `store` (the step's
K/V land exactly in their slots and nowhere else among the pages used), `decode` (steps
whose requests add one token each, one step per batch size; long enough for the Triton
backend's split-KV path) and `prefill` (one mixed step: several requests, some with a
cached prefix, lengths that end mid-page, and a one-token row among them). The pages used
are the pool's first ones, filled with random keys and values: at start-up no request holds
them. The reference is computed in float32 from a copy of what the pages must hold, so a
broken store cannot hide a broken attention, and it shares no code with either backend.

An exception anywhere (a kernel the compiler refuses, a launch that fails) is a failed
result naming it; nothing is raised. Errors are the largest absolute difference from the
reference, with a tolerance per dtype (`TOLERANCE`): random N(0, 1) inputs, so outputs are
of order one and the tolerance is a few units of the dtype's last place.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

import torch

from minisgl.kvcache import pages_for

from .base import AttentionBackend, ForwardInfo

# Largest absolute error against the float32 reference. bfloat16 keeps 8 bits of mantissa
# (2**-8 = 0.004 of a value of order one, several roundings deep), float16 11; float32 is
# computed with TF32 products by Triton's tl.dot on recent GPUs (10 bits as well).
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class CheckResult:
    """One check of the fast path: what it compared, whether it passed and by how much."""

    name: str  # e.g. "triton decode"
    part: str  # the part a failure falls back from: triton, torch, cuda_graph, overlap
    passed: bool
    max_error: float | None = None
    tolerance: float | None = None
    detail: str = ""  # the shapes checked, or the exception
    seconds: float = 0.0
    shape: dict = field(default_factory=dict)
    measure: str = "max error"  # what max_error counts

    def describe(self) -> str:
        """One line: what failed (or passed) and the numbers."""
        if self.max_error is not None and self.tolerance is not None:
            op = "<=" if self.passed else ">"
            numbers = f"{self.measure} {self.max_error:.3g} {op} tolerance {self.tolerance:.3g}"
        else:
            numbers = "passed" if self.passed else "failed"
        where = f" ({self.detail})" if self.detail else ""
        return f"{self.name}: {numbers}{where}"

    def as_dict(self) -> dict:
        return asdict(self)


def decode_lengths(batch: int, max_len: int, page_size: int, seed: int) -> list[int]:
    """KV lengths of a decode step of `batch` requests: one of a single token, one of
    `max_len` (the most splits), the rest spread between, ending mid-page and on a page."""
    rng = random.Random(seed)
    lens = [min(n, max_len) for n in (1, max_len, page_size, page_size + 1)][:batch]
    lens += [rng.randint(1, max_len) for _ in range(batch - len(lens))]
    return lens


def mixed_layout(max_len: int, page_size: int) -> list[tuple[int, int]]:
    """(cached, new) per request of a mixed step: prefills with and without a cached
    prefix, ending mid-page, and a decode row among them."""
    n = max(8, max_len // 8)
    return [(0, n + 1), (3 * page_size + 1, 1), (2 * page_size + 3, n // 2 + 2), (1, n)]


def paged_layout(
    reqs: list[tuple[int, int]], page_size: int, first_page: int, seed: int, device
) -> ForwardInfo:
    """A step over pages `first_page`, `first_page + 1`, ... handed to the requests in a
    shuffled order (so a request's pages are not adjacent); `reqs` are (cached, new)."""
    rng = random.Random(seed)
    counts = [pages_for(c + e, page_size) for c, e in reqs]
    pages = list(range(first_page, first_page + sum(counts)))
    rng.shuffle(pages)
    table = torch.zeros(len(reqs), max(counts), dtype=torch.int32)
    for i, count in enumerate(counts):
        table[i, :count] = torch.tensor([pages.pop() for _ in range(count)], dtype=torch.int32)
    ext = torch.tensor([e for _, e in reqs])
    cached = torch.tensor([c for c, _ in reqs])
    req_of_tok = torch.repeat_interleave(torch.arange(len(reqs)), ext)
    first = torch.cumsum(ext, 0) - ext
    pos = cached[req_of_tok] + torch.arange(int(ext.sum())) - first[req_of_tok]
    slots = table[req_of_tok, pos // page_size].long() * page_size + pos % page_size
    return ForwardInfo(
        positions=pos.to(device),
        out_slots=slots.to(device),
        block_table=table.to(device),
        seq_lens=(cached + ext).int().to(device),
        extend_lens_cpu=ext.tolist(),
        cached_lens_cpu=cached.tolist(),
    )


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, info: ForwardInfo, ps: int
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole sequence, read slot by
    slot from float32 caches (S, Hkv, D), in float32: (T, H, D)."""
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[1]
    out, start = [], 0
    for i, (n, c) in enumerate(zip(info.extend_lens_cpu, info.cached_lens_cpu)):
        pos = torch.arange(c + n, device=q.device)
        slots = info.block_table[i, pos // ps].long() * ps + pos % ps
        k = k_cache[slots].repeat_interleave(group, dim=1)  # (S, H, D)
        v = v_cache[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,shd->hns", q[start : start + n].float(), k) * D**-0.5
        allowed = pos[None, :] <= (torch.arange(n, device=q.device) + c)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hns,shd->nhd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


def check_attention(
    backend: AttentionBackend,
    name: str,
    *,
    decode_batches: tuple[int, ...] = (1, 7),
    max_len: int = 2048,
    max_tokens: int = 32768,
    seed: int = 0,
    layer: int = 0,
) -> list[CheckResult]:
    """`backend` against the reference on its own pool: decode, prefill and store results.
    Decode requests have up to `max_len` tokens, and a step at most `max_tokens` in all."""
    pool = backend.pool
    ps, dtype, device = pool.page_size, pool.k.dtype, pool.k.device
    H, Hkv, D = backend.num_heads, pool.k.shape[2], backend.head_dim
    steps = _steps(decode_batches, max_len, max_tokens, ps, pool.num_pages, seed)
    max_len = max(c + n for _, reqs in steps for c, n in reqs)
    dtype_name = str(dtype).removeprefix("torch.")
    shape = dict(dtype=dtype_name, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=ps)
    what = f"{dtype_name}, heads {H}/{Hkv} (query/KV), head dim {D}, page {ps}"
    details = {  # the store last: it runs inside the others
        "decode": f"{what}, batch {'/'.join(map(str, decode_batches))}, up to {max_len} tokens",
        "prefill": f"{what}, {len(steps[-1][1])} requests with cached prefixes",
        "store": what,
    }
    errors = dict.fromkeys(details, 0.0)
    seconds = dict.fromkeys(details, 0.0)
    failures: dict[str, str] = {}
    gen = torch.Generator(device=device).manual_seed(seed)
    for i, (kind, reqs) in enumerate(steps):
        if kind in failures:
            continue
        started = time.perf_counter()
        try:
            info = paged_layout(reqs, ps, 0, seed + i, device)
            region = slice(0, (int(info.block_table.max()) + 1) * ps)  # the pages used
            T = sum(info.extend_lens_cpu)
            pool.k[layer][region].normal_(generator=gen)
            pool.v[layer][region].normal_(generator=gen)
            q, k, v = (
                torch.randn(T, h, D, generator=gen, device=device).to(dtype) for h in (H, Hkv, Hkv)
            )
            # what the pages must hold after the step, in float32 (a copy, whatever the dtype)
            expected_k = pool.k[layer][region].to(torch.float32, copy=True)
            expected_v = pool.v[layer][region].to(torch.float32, copy=True)
            expected_k[info.out_slots], expected_v[info.out_slots] = k.float(), v.float()
            out = backend.attention(layer, q, k, v, backend.prepare(info))
            store_err = max(
                (pool.k[layer][region].float() - expected_k).abs().max().item(),
                (pool.v[layer][region].float() - expected_v).abs().max().item(),
            )
            ref = reference_attention(q, expected_k, expected_v, info, ps)
            err = (out.float() - ref).abs().max().item()
        except Exception as exc:  # a refused kernel, a failed launch: this part fails
            failures[kind] = f"{type(exc).__name__}: {first_line(exc)}"
            continue
        finally:
            seconds[kind] += time.perf_counter() - started
        errors["store"] = _worst(errors["store"], store_err)
        errors[kind] = _worst(errors[kind], err)
    if failures:  # the store ran inside the failed steps: not known to work
        failures.setdefault(
            "store", f"not known, its step failed ({next(iter(failures.values()))})"
        )

    tol = TOLERANCE.get(dtype, 3e-2)
    results = []
    for kind, detail in details.items():
        kind_tol = 0.0 if kind == "store" else tol  # the store is a copy: exact
        if kind in failures:
            result = CheckResult(
                f"{name} {kind}", name, False, detail=f"{detail}: {failures[kind]}"
            )
        else:
            passed = errors[kind] <= kind_tol  # NaN fails
            result = CheckResult(f"{name} {kind}", name, passed, errors[kind], kind_tol, detail)
        result.seconds, result.shape = seconds[kind], dict(shape)
        if kind == "decode":
            result.shape.update(batch_sizes=list(decode_batches), max_len=max_len)
        results.append(result)
    return results


def _steps(decode_batches, max_len: int, max_tokens: int, ps: int, num_pages: int, seed: int):
    """The steps checked, as (kind, [(cached, new)...]); lengths halved until every step
    fits in the pool's pages."""
    while True:
        steps = [
            ("decode", [(n - 1, 1) for n in decode_lengths(b, limit, ps, seed + b)])
            for b in decode_batches
            if (limit := max(2, min(max_len, max_tokens // b)))
        ]
        steps.append(("prefill", mixed_layout(max_len, ps)))
        pages = max(sum(pages_for(c + n, ps) for c, n in reqs) for _, reqs in steps)
        if pages <= num_pages or max_len <= 2:
            return steps
        max_len //= 2


def _worst(a: float, b: float) -> float:
    return b if b != b or b > a else a  # NaN sticks


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
