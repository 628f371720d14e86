"""The torch backend against a plain attention written out from the definition.

Every request's pages are scattered over the pool out of order, every slot no request
wrote holds NaN (only the scratch page is zero, as the pool promises), and the batches mix
decodes with prefills that have and have not a cached prefix, under grouped-query attention,
with lengths that end on a page boundary and mid-page. A backend that reads a wrong page,
a wrong slot, a wrong KV head, or lets an unwritten slot reach a result fails.
"""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.attention.base import ForwardInfo
from minisgl.attention.torch_backend import TorchBackend
from minisgl.kvcache import KVCachePool

PS = 4  # page size


def _reference(q, keys, values, cached: int) -> torch.Tensor:
    """q: (n, H, D) new queries at positions cached..cached+n-1; keys/values: (S, Hkv, D)
    with S = cached + n. Causal softmax attention in float64; query head i reads KV head
    i // (H // Hkv)."""
    n, H, D = q.shape
    G = H // keys.shape[1]
    k = keys.double().repeat_interleave(G, dim=1)  # (S, H, D)
    v = values.double().repeat_interleave(G, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.double(), k) / D**0.5
    q_pos = torch.arange(n)[:, None] + cached
    scores = scores.masked_fill(torch.arange(len(keys))[None, :] > q_pos, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v).float()


def _run(reqs, H, Hkv, D, seed, two_threads=False):
    """reqs: (cached, new) per request. Returns the backend's output and the reference."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_pages = sum(-(-(c + n) // PS) for c, n in reqs) + 5  # a few pages nobody owns
    pool = KVCachePool(2, num_pages, PS, Hkv, D, torch.float32, torch.device("cpu"))
    pool.k[:, : num_pages * PS] = float("nan")  # "uninitialised": only the scratch page is 0
    pool.v[:, : num_pages * PS] = float("nan")
    layer = 1

    free = list(range(num_pages))
    rng.shuffle(free)  # pages out of order, not adjacent
    P = max(-(-(c + n) // PS) for c, n in reqs) + 1  # one padding column beyond the longest
    # the padding is a page nobody owns, all NaN: a backend must not read it unmasked
    table = torch.full((len(reqs), P), free[0], dtype=torch.int32)
    free = free[1:]
    history = []  # (keys, values) of each request's whole sequence
    for i, (c, n) in enumerate(reqs):
        for j in range(-(-(c + n) // PS)):
            table[i, j] = free.pop()
        keys, values = torch.randn(c + n, Hkv, D), torch.randn(c + n, Hkv, D)
        slots = table[i, torch.arange(c) // PS].long() * PS + torch.arange(c) % PS
        pool.store(layer, slots, keys[:c], values[:c])  # the cached prefix
        history.append((keys, values))

    positions = torch.cat([torch.arange(c, c + n) for c, n in reqs])
    req_of_tok = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(reqs)])
    out_slots = table[req_of_tok, positions // PS].long() * PS + positions % PS
    info = ForwardInfo(
        positions=positions,
        out_slots=out_slots,
        block_table=table,
        seq_lens=torch.tensor([c + n for c, n in reqs], dtype=torch.int32),
        extend_lens_cpu=[n for _, n in reqs],
        cached_lens_cpu=[c for c, _ in reqs],
    )
    q = torch.randn(len(positions), H, D)
    k = torch.cat([keys[c:] for (c, _), (keys, _) in zip(reqs, history)])
    v = torch.cat([values[c:] for (c, _), (_, values) in zip(reqs, history)])

    backend = TorchBackend(pool, H, D)
    backend.two_threads = two_threads
    got = backend.attention(layer, q, k, v, backend.prepare(info))

    expected, start = [], 0
    for (c, n), (keys, values) in zip(reqs, history):
        expected.append(_reference(q[start : start + n], keys, values, c))
        start += n
    # the step's keys and values landed in their slots
    assert torch.equal(pool.k[layer][out_slots], k) and torch.equal(pool.v[layer][out_slots], v)
    return got, torch.cat(expected)


MIXED = [
    (7, 1),  # decode ending on a page boundary (8 keys)
    (0, 6),  # prefill, nothing cached, mid-page
    (9, 1),  # decode mid-page (10 keys)
    (8, 5),  # prefill over a cached prefix that fills two pages
    (2, 1),  # short decode: every other request's extra pages are padding for it
    (5, 7),  # prefill over a cached prefix, ending on a page boundary (12 keys)
]
DECODES = [(7, 1), (9, 1), (0, 1), (22, 1), (3, 1)]  # lengths 8 10 1 23 4


@pytest.mark.parametrize("reqs", [MIXED, DECODES], ids=["mixed", "decode-only"])
@pytest.mark.parametrize(("H", "Hkv"), [(6, 2), (4, 4), (3, 1)], ids=["gqa", "mha", "mqa"])
def test_torch_backend_matches_plain_attention(reqs, H, Hkv) -> None:
    got, expected = _run(reqs, H, Hkv, D=8, seed=H * 10 + Hkv)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reqs", [MIXED, DECODES], ids=["mixed", "decode-only"])
def test_decodes_split_over_two_threads_give_one_threads_values(reqs, split_halves) -> None:
    # every decode batch splits (a CPU scheduler on one torch thread splits large ones)
    helped = split_halves
    one, expected = _run(reqs, 6, 2, D=8, seed=5)
    assert helped == []
    two, _ = _run(reqs, 6, 2, D=8, seed=5, two_threads=True)
    decodes = sum(n == 1 for _, n in reqs)
    assert sorted(h[0] for h in helped) == [decodes // 2, decodes - decodes // 2]  # halves
    # SDPA blocks a batch by its size: the halves agree with the whole up to rounding
    torch.testing.assert_close(two, one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(two, expected, rtol=1e-5, atol=1e-5)


def test_a_decode_sees_only_its_own_pages() -> None:
    """Two decodes over the same positions of different pages must differ: a backend that
    read one request's pages for another would give equal outputs."""
    got, expected = _run([(5, 1), (5, 1)], 4, 2, D=8, seed=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], got[1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("reqs", [MIXED, DECODES], ids=["mixed", "decode-only"])
def test_on_cuda_a_step_never_makes_the_host_wait(backend_name, reqs) -> None:
    """Per step and per layer: no `.item()`, no blocking copy, nothing that makes the host
    wait for the device (torch's sync debug mode raises on each). The fallback path must be
    as asynchronous as the fast one, or overlap scheduling stalls on it."""
    from minisgl.attention import create_attention_backend
    from minisgl.attention.check import paged_layout

    device = torch.device("cuda")
    pool = KVCachePool(4, 64, PS, 2, 64, torch.bfloat16, device)
    backend = create_attention_backend(backend_name, pool, 4, 64, device)
    info = paged_layout(reqs, PS, 0, seed=0, device=device)
    T = sum(info.extend_lens_cpu)
    q, k, v = (torch.randn(T, h, 64, device=device, dtype=torch.bfloat16) for h in (4, 2, 2))
    backend.attention(0, q, k, v, backend.prepare(info))  # compile, warm the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = backend.prepare(info)
        for layer in range(4):
            backend.attention(layer, q, k, v, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
