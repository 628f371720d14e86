"""How much memory the machine has available, where the OS tells it differently: Linux's
/proc/meminfo, a POSIX system's free pages, and macOS's `vm_stat` (no /proc there, and no
SC_AVPHYS_PAGES: the CPU engine could not size its KV pool without --num-pages)."""

from __future__ import annotations

import builtins
import os
import subprocess

import pytest

from minisgl.utils import process
from minisgl.utils.process import available_ram, vm_stat_available

# `vm_stat` on an Apple silicon Mac (16 KiB pages)
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12345.
Pages active:                            400000.
Pages inactive:                          200000.
Pages speculative:                         5000.
Pages throttled:                              0.
Pages wired down:                        150000.
"""


def test_vm_stat_counts_free_inactive_and_speculative_pages():
    assert vm_stat_available(VM_STAT) == 16384 * (12345 + 200000 + 5000)
    with pytest.raises(RuntimeError, match="vm_stat"):
        vm_stat_available("page size of 4096 bytes\nnothing else\n")


def test_without_proc_and_sc_avphys_pages_the_mac_way_is_taken(monkeypatch):
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    names = {k: v for k, v in os.sysconf_names.items() if k != "SC_AVPHYS_PAGES"}
    monkeypatch.setattr(os, "sysconf_names", names)
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=VM_STAT, stderr="")

    monkeypatch.setattr(process.subprocess, "run", fake_run)
    assert available_ram() == 16384 * (12345 + 200000 + 5000)
    assert ran == [["vm_stat"]]


def test_on_linux_it_is_memavailable():
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
    expected = int(line.split()[1]) * 1024
    assert abs(available_ram() - expected) < max(expected // 10, 64 << 20)
