"""Gather helpers: single-process fallback and real 2-rank gloo behaviour with unequal sizes."""

from __future__ import annotations

import pytest
import torch
from kits.multiproc import run_world

from vltrain.runtime.distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    gather_sizes,
    init_distributed,
    world_info,
)
from vltrain.runtime.world import allow_tf32


def test_single_process_fallback(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == (0, 1)
    assert world_info() == (0, 1)
    x = torch.randn(3, 2, requires_grad=True)
    assert all_gather_with_grad(x) is x
    assert torch.equal(all_gather_no_grad(x), x.detach())
    assert gather_sizes(3) == [3]


def test_tf32_is_allowed_on_cuda_only():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        allow_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"  # CPU numerics untouched
        allow_tf32(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        allow_tf32(torch.device("cuda", 0), enabled=False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def _gather_worker(rank, world):
    n = 2 + rank  # unequal local sizes: 2 and 3
    x = (torch.arange(n * 2, dtype=torch.float64).view(n, 2) + 100 * rank).requires_grad_()
    gathered = all_gather_with_grad(x)
    # every rank's loss weights the gathered rows differently: the backward must sum them over ranks
    coef = torch.arange(gathered.shape[0], dtype=torch.float64)[:, None] * (rank + 1)
    (gathered * coef).sum().backward()
    flags = all_gather_no_grad(torch.arange(n) % 2 == rank)  # bool, which gloo does not gather itself
    return gathered.detach(), x.grad, all_gather_no_grad(torch.full((n,), rank)), flags


@pytest.mark.timeout(120)
def test_gather_with_grad_unequal_sizes():
    results = run_world(_gather_worker, timeout=60)
    expected = torch.cat([torch.arange(4.0).view(2, 2), torch.arange(6.0).view(3, 2) + 100]).double()
    summed_coef = torch.arange(5, dtype=torch.float64)[:, None].expand(5, 2) * (1 + 2)
    for rank, (gathered, grad, ranks, flags) in enumerate(results):
        assert torch.equal(gathered, expected)
        start, n = (0, 2) if rank == 0 else (2, 3)
        assert torch.equal(grad, summed_coef[start : start + n])
        assert ranks.tolist() == [0, 0, 1, 1, 1]
        assert flags.dtype == torch.bool and flags.tolist() == [True, False, False, True, False]


_ALLOCATE_AND_FREE = """
import ctypes, sys, torch
from vltrain.runtime.world import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2()
activation = torch.empty(20 << 20, dtype=torch.uint8).fill_(1)
alive = libc.mallinfo2()
del activation
freed = libc.mallinfo2()
print(alive.hblkhd - before.hblkhd, freed.fordblks)
"""


def test_keep_freed_memory_keeps_a_freed_activation_in_the_heap():
    """glibc's default serves a 20 MiB block from fresh mmap pages and unmaps it when freed (the
    next step faults it in again); with ``keep_freed_memory`` it comes from the heap and stays
    there, free for the next step."""
    import ctypes.util
    import os
    import subprocess
    import sys

    if sys.platform != "linux" or ctypes.util.find_library("c") != "libc.so.6":
        pytest.skip("glibc only")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    mib = 1 << 20
    out = {}
    for mode in ("default", "keep"):
        run = subprocess.run([sys.executable, "-c", _ALLOCATE_AND_FREE, mode], env=env, check=True,
                             capture_output=True, text=True)
        out[mode] = [int(v) for v in run.stdout.split()[-2:]]
    mmapped, _ = out["default"]
    assert mmapped >= 20 * mib
    mmapped, free_in_heap = out["keep"]
    assert mmapped == 0
    assert free_in_heap >= 20 * mib
