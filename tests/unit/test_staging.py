"""Staging: host arrays reach the device intact, on the CPU (no copy) and through the
pinned ring on CUDA, however many copies wrap around it and whatever their sizes."""

from __future__ import annotations

import pytest
import torch

from minisgl.utils.staging import Staging

DTYPES = [torch.int64, torch.int32, torch.float32, torch.bool]


def _values(i: int, n: int, dtype: torch.dtype) -> list:
    if dtype is torch.bool:
        return [(i + j) % 3 == 0 for j in range(n)]
    if dtype is torch.float32:
        return [float(i) + j / 4 for j in range(n)]
    return [i * 1000 + j for j in range(n)]


def _round_trip(device: torch.device) -> None:
    staging = Staging(device, depth=4, min_bytes=64)  # a small ring: it wraps and grows
    kept = []
    for i in range(40):
        dtype = DTYPES[i % len(DTYPES)]
        n = (i * 37) % 300 + 1  # sizes past the buffers' first size make them grow
        data = _values(i, n, dtype)
        if i % 2:
            out = staging.to_device(data, dtype)
        else:  # the two-call form the input builder uses: fill the host array in place
            host = staging.host(n, dtype)
            host[:] = data
            out = staging.copy(host)
        assert out.device.type == device.type and out.dtype == dtype
        kept.append((out, data))
    # every tensor still holds its own values after the ring was reused many times over
    for out, data in kept:
        assert out.cpu().tolist() == data


def test_staging_on_the_cpu_returns_the_values() -> None:
    _round_trip(torch.device("cpu"))


def test_cpu_staging_hands_out_fresh_arrays() -> None:
    staging = Staging(torch.device("cpu"))
    a = staging.copy(staging.host(4, torch.int64))
    a.fill_(7)
    b = staging.copy(staging.host(4, torch.int64))
    b.fill_(1)
    assert a.tolist() == [7] * 4  # nothing aliases an earlier step's tensors


@pytest.mark.gpu
def test_staging_through_the_pinned_ring_on_cuda() -> None:
    _round_trip(torch.device("cuda"))
