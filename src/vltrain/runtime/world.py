"""How this process runs: its device, matmul precision, threads and allocator.

These are settings of the process, not collectives, so they live apart from
``vltrain.runtime.distributed``; :func:`setup_world` joins the process group through it and then applies
them, in the order a run needs them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

from vltrain.errors import ConfigError
from vltrain.runtime import allocator
from vltrain.runtime.cpus import usable_cpus
from vltrain.runtime.distributed import World, init_distributed
from vltrain.runtime.precision import cpu_has_bf16_matmul  # noqa: F401  (where the trainer and demo look)
from vltrain.runtime.spmd import RECORDER


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available; use train.device=auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def allow_tf32(device: torch.device, enabled: bool = True) -> None:
    """On CUDA, let fp32 matmuls run on TF32 tensor cores (Ampere and newer).

    PyTorch keeps full fp32 matmuls by default; TF32 keeps fp32's range with a 10-bit mantissa,
    which training does not notice, and runs on the tensor cores. Under bf16 autocast it only
    concerns what stays in fp32 (the losses). On CPU this changes nothing, so CPU loss curves stay
    bit-identical.
    """
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if enabled else "highest")


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Let glibc's malloc reuse freed tensor memory instead of handing it back to the kernel.

    By default glibc serves allocations above a few MiB with fresh ``mmap`` pages and returns freed
    heap tops to the kernel, so every step's activations page-fault in zeroed memory again (the
    cost: ``docs/benchmarks/cpu-training.md#trainer-step-throughput-fp32-vs-bf16-autocast-mfu``). Raising the
    mmap threshold to its maximum (32 MiB) and the trim threshold to 1 GiB keeps the memory in the
    process, at the price of a higher resident size between steps. Returns False where the C
    library is not glibc, or another allocator is preloaded (``vltrain.runtime.allocator``; then
    nothing changes).
    """
    if allocator.loaded() != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def make_deterministic(device: torch.device) -> None:
    """Only deterministic kernels from here on (``train.deterministic``), so two runs on a GPU are
    bit-identical: a kernel without a deterministic version raises instead of running.

    cuBLAS needs a fixed workspace (set before its first call); cuDNN may not pick kernels by timing;
    the fused attention kernels accumulate some gradients with atomics, so attention falls back to
    the math backend. On a CPU the step is deterministic at any fixed thread count without this
    (gathers whose backward accumulates use ``index_select``, whose backward adds in a fixed order)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


def setup_world(*, timeout_s: float = 600.0, device: str = "auto", threads: int = 0, tf32: bool = True,
                debug_spmd: bool = False, deterministic: bool = False) -> World:
    """Join torchrun's process group (or run alone), pick the device, matmul precision, threads and,
    on CPU under glibc's malloc, its reuse of freed memory (``keep_freed_memory``; TCMalloc, which
    the ``vltrain`` command preloads where installed, needs no tuning: ``vltrain.runtime.allocator``);
    ``debug_spmd`` turns the SPMD check of every collective on (``vltrain.runtime.spmd``).

    ``threads=0`` divides the CPUs this process may use (``usable_cpus``) among the processes of
    this node, so that ``torchrun --nproc-per-node 2`` on 2 cores gives each rank one thread instead
    of both fighting over two.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    rank, world_size = init_distributed(backend=backend, timeout_s=timeout_s)
    RECORDER.checking = debug_spmd
    allow_tf32(dev, tf32)
    if deterministic:
        make_deterministic(dev)
    if dev.type == "cpu":
        keep_freed_memory()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(threads or max(1, usable_cpus() // local_world))
    return World(rank, world_size, local_rank, dev)
