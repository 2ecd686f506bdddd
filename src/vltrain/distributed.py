"""Process-group set-up and the collectives the losses need.

Everything here falls back to a single process when torch.distributed is not initialized, so the
same loss code runs on a laptop and on many nodes. The gathers accept a different first-dimension
size on every rank (dynamic batching makes local batches unequal): sizes are exchanged first, the
tensors padded to the largest, gathered, and the padding dropped.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
import os

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_info() -> tuple[int, int]:
    """(rank, world_size); (0, 1) when torch.distributed is not initialized."""
    if not is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; a no-op without it.

    The backend defaults to NCCL when CUDA is available and gloo otherwise. ``timeout_s`` bounds how
    long a collective waits for a rank that died, so a failure ends the job instead of hanging it.
    """
    if is_initialized() or "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return world_info()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    one_agent = os.environ.get("GROUP_WORLD_SIZE") == "1"  # one torchrun: one restart count for all
    if restart is not None and one_agent and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store outlives a restart of the group: in a namespace of their own, the
        # restarted workers cannot read the dead workers' addresses and fail (or hang) connecting
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"vltrain/attempt_{restart}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return world_info()


def gather_sizes(n: int, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's first-dimension size, in rank order (one tiny all_gather)."""
    rank, world = world_info()
    if world == 1:
        return [n]
    local = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(out, local)
    return [int(t.item()) for t in out]


def _gather_padded(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, padding to the largest size for the collective."""
    longest = max(sizes)
    if x.shape[0] < longest:
        pad = x.new_zeros((longest - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad], dim=0)
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


def all_gather_no_grad(x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Every rank's rows concatenated in rank order, without a gradient path."""
    rank, world = world_info()
    if world == 1:
        return x.detach()
    sizes = sizes if sizes is not None else gather_sizes(x.shape[0], x.device)
    with torch.no_grad():
        return _gather_padded(x.detach(), sizes)


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: concatenation of all ranks' rows. Backward: this rank's slice of the summed gradient.

    Each rank's loss touches every rank's rows, so the gradient of the sum of all ranks' losses with
    respect to this rank's rows is the all-reduced (summed) gradient of the gathered tensor, sliced.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.sizes, ctx.rank = sizes, rank
        return _gather_padded(x, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def all_gather_with_grad(x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Every rank's rows concatenated in rank order; gradients flow back to the rank that owns them."""
    rank, world = world_info()
    if world == 1:
        return x
    sizes = sizes if sizes is not None else gather_sizes(x.shape[0], x.device)
    return _AllGatherWithGrad.apply(x, sizes, rank)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks without a gradient path (counts and normalizers)."""
    if world_info()[1] == 1:
        return x.detach()
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


# ---------------------------------------------------------------------------------------------
# The trainer's view of the process group


@dataclass
class World:
    """Where this process runs: rank, world size, local rank, device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self, clean: bool = True) -> None:
        """Leave the process group (every rank, at the end of a run).

        After a clean run the ranks first meet at a barrier, so that none tears its connections
        down while another still has collectives in flight (with gloo that can abort the process
        at exit). After a failure there is no barrier: the other ranks may never arrive.
        """
        if is_initialized():
            if clean and self.world_size > 1:
                dist.barrier()
            dist.destroy_process_group()


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from vltrain.config import ConfigError

            raise ConfigError("train.device=cuda but CUDA is not available; use train.device=auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def allow_tf32(device: torch.device, enabled: bool = True) -> None:
    """On CUDA, let fp32 matmuls run on TF32 tensor cores (Ampere and newer).

    PyTorch keeps full fp32 matmuls by default; TF32 keeps fp32's range with a 10-bit mantissa,
    which training does not notice, and is several times faster. Under bf16 autocast it only
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
    heap tops to the kernel, so every step's activations page-fault in zeroed memory again: on CPU
    that costs 10-20% of a bf16 training step (the glibc row of ``benchmarks/step_throughput.py``). Raising the
    mmap threshold to its maximum (32 MiB) and the trim threshold to 1 GiB keeps the memory in the
    process, at the price of a higher resident size between steps. Returns False where the C library
    is not glibc (then nothing changes).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def setup_world(*, timeout_s: float = 600.0, device: str = "auto", threads: int = 0, tf32: bool = True) -> World:
    """Join torchrun's process group (or run alone), pick the device, matmul precision, threads and,
    on CPU, the allocator's reuse of freed memory (``keep_freed_memory``).

    ``threads=0`` divides the machine's cores among the processes of this node, so that
    ``torchrun --nproc-per-node 2`` on 2 cores gives each rank one thread instead of both
    fighting over two.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    rank, world_size = init_distributed(backend=backend, timeout_s=timeout_s)
    allow_tf32(dev, tf32)
    if dev.type == "cpu":
        keep_freed_memory()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    return World(rank, world_size, local_rank, dev)
