"""Process-group set-up and the collectives the losses need.

Everything here falls back to a single process when torch.distributed is not initialized, so the
same loss code runs on a laptop and on many nodes. A tensor that crosses ranks may differ between
them in any dimension (dynamic batching makes local batches unequal; each rank pads its captions to
its own longest): the shapes are exchanged first, every dimension padded to the largest over ranks
for the collective, and the padding dropped (or, beyond the first dimension, kept and masked) after.
No collective's size depends on a rank's data without such an exchange first. Every collective
goes through :func:`issue`, the SPMD recorder's door (``vltrain.runtime.spmd``).
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any group exists: see group_threads)

from vltrain.runtime.spmd import MAX_DIMS, RECORDER, Issued, SPMDError

T = TypeVar("T")


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


GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl")
"""The name prefixes of the threads that process groups start (gloo's workers and transport loop,
NCCL's watchdog and heartbeat monitor)."""


def group_threads() -> list[str]:
    """The names of this process's threads that belong to a process group (Linux; [] elsewhere).

    A gloo group's worker threads live until the group object is freed, not until
    ``destroy_process_group``. A worker that finishes a collective drops its work afterwards, and
    dropping a tensor that Python made needs the GIL: if the interpreter is shutting down by then,
    the thread is ended inside a C++ destructor and the process aborts (``terminate called without
    an active exception``). So a run must free its groups before it returns, and this says whether
    it did. One holder is in torch itself: ``torch.distributed.nn.functional`` captures the default
    group in its default arguments when first imported (DDP imports it), which is why this module
    imports it before any group exists.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(GROUP_THREADS):
            names.append(name)
    return sorted(names)


def release_mesh(mesh: Any) -> None:
    """Let a device mesh's process groups go, once nothing will run on the mesh again.

    A mesh keeps its groups in ``_pg_registry``, and DTensor's sharding caches keep every mesh
    they have seen for the life of the interpreter (torch 2.13): without this, FSDP2's groups and
    their threads outlive ``destroy_process_group`` (:func:`group_threads`).
    """
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


def issue(op: str, tensor: torch.Tensor | None, run: Callable[[], T], *, sent: int = 0) -> T:
    """Run one collective through the recorder (``vltrain.runtime.spmd``): every collective vltrain issues
    itself comes here, so ``train.debug_spmd`` can compare the ranks before it runs and
    ``benchmarks/comm_cost.py`` can count the bytes each rank sends."""
    issued = Issued(op) if tensor is None else Issued(op, tensor.dtype, tuple(tensor.shape))
    # host tensors travel over the host group (gloo); the check runs on the main group's device
    device = tensor.device if tensor is not None and tensor.device.type != "cpu" else _collective_device()
    RECORDER.before(issued, sent, device)
    return run()


_HOST_GROUP: list = []


def host_group() -> dist.ProcessGroup | None:
    """The group for host values (shapes, flags): the main group under gloo, else a gloo group
    beside it, made on first use (every rank reaches that first use at the same point)."""
    if dist.get_backend() == "gloo":
        return None
    if not _HOST_GROUP:
        _HOST_GROUP.append(dist.new_group(backend="gloo"))
    return _HOST_GROUP[0]


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def exchange_shapes(*tensors: torch.Tensor) -> list[list[tuple[int, ...]]]:
    """Every rank's shape of each tensor: ``out[i][r]`` is rank r's shape of ``tensors[i]``.

    One small all_gather of a fixed-size vector, whatever the tensors hold, so it cannot itself
    mismatch. Every rank must pass the same number of tensors with the same number of dimensions
    (that is code, not data). Shapes are host values: they travel over host memory (gloo), so
    the step never waits for the device to learn them.
    """
    rank, world = world_info()
    if world == 1:
        return [[tuple(t.shape)] for t in tensors]
    width = 1 + MAX_DIMS
    local = torch.full((len(tensors), width), -1, dtype=torch.int64)
    for i, t in enumerate(tensors):
        if t.ndim > MAX_DIMS:
            raise ValueError(f"exchange_shapes supports up to {MAX_DIMS} dimensions, got {t.ndim}")
        local[i, 0] = t.ndim
        local[i, 1 : 1 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    local = local.flatten()
    parts = [torch.empty_like(local) for _ in range(world)]
    group = host_group()
    issue("shapes", local, lambda: dist.all_gather(parts, local, group=group), sent=local.numel() * 8 * (world - 1))
    table = torch.stack(parts).view(world, len(tensors), width).tolist()  # host memory: no wait
    out = []
    for i in range(len(tensors)):
        ndims = {table[r][i][0] for r in range(world)}
        if len(ndims) != 1:
            raise SPMDError(f"exchange_shapes: tensor {i} has {sorted(ndims)} dimensions on different ranks")
        n = ndims.pop()
        out.append([tuple(table[r][i][1 : 1 + n]) for r in range(world)])
    return out


def gather_sizes(n: int, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's first-dimension size, in rank order (one tiny all_gather)."""
    return [s[0] for s in exchange_shapes(torch.empty(n, 0, device=device))[0]]


def _padded_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(max(dims) for dims in zip(*shapes))


def pad_to(x: torch.Tensor, shape: tuple[int, ...], value: float = 0) -> torch.Tensor:
    """``x`` grown to ``shape`` (every dimension at least as large), new entries ``value``."""
    if tuple(x.shape) == tuple(shape):
        return x
    out = x.new_full(shape, value)
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def _gather_padded(x: torch.Tensor, shapes: list[tuple[int, ...]], value: float) -> torch.Tensor:
    """Every rank's ``x``, concatenated along dim 0 in rank order, other dims padded to the largest.

    For the collective every rank sends a tensor of the same (largest) shape in every dimension;
    each part is then cut back to its rank's rows.
    """
    big = _padded_shape(shapes)
    send = pad_to(x, big, value).contiguous()
    parts = [torch.empty_like(send) for _ in shapes]
    issue("all_gather", send, lambda: dist.all_gather(parts, send), sent=send.numel() * send.element_size() * (len(shapes) - 1))
    return torch.cat([p[: s[0]] for p, s in zip(parts, shapes)], dim=0)


def _shapes_of(x: torch.Tensor, shapes: list[tuple[int, ...]] | None) -> list[tuple[int, ...]]:
    if shapes is None:
        return exchange_shapes(x)[0]
    rank = world_info()[0]
    if tuple(shapes[rank]) != tuple(x.shape):
        raise ValueError(f"shapes[{rank}] is {tuple(shapes[rank])} but the tensor is {tuple(x.shape)}")
    return shapes


def all_gather_no_grad(x: torch.Tensor, shapes: list[tuple[int, ...]] | None = None, pad_value: float = 0) -> torch.Tensor:
    """Every rank's rows concatenated in rank order, without a gradient path.

    Ranks may differ in any dimension: every dimension but the first is padded with ``pad_value``
    to the largest over ranks. ``shapes`` (from :func:`exchange_shapes`) saves the exchange.
    """
    if world_info()[1] == 1:
        return x.detach()
    if x.dtype == torch.bool:  # gloo gathers no bool: widen, gather, narrow
        return all_gather_no_grad(x.to(torch.uint8), shapes, pad_value).bool()
    shapes = _shapes_of(x, shapes)
    with torch.no_grad():
        return _gather_padded(x.detach(), shapes, pad_value)


REDUCE_SCATTER = True
"""Gather-with-grad's backward reduce-scatters (False: all-reduces the whole gradient, then slices)."""


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: concatenation of all ranks' rows. Backward: this rank's slice of the summed gradient.

    Each rank's loss touches every rank's rows, so the gradient of the sum of all ranks' losses with
    respect to this rank's rows is the sum over ranks of the gathered tensor's gradient, sliced to
    this rank's rows. A reduce-scatter delivers exactly that slice (on NCCL for half the bytes of
    an all-reduce of the whole gradient; gloo implements it as that all-reduce); backends without
    it fall back to the all-reduce.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, shapes: list[tuple[int, ...]], rank: int, value: float) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes, ctx.rank = shapes, rank
        return _gather_padded(x, shapes, value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        shapes, rank = ctx.shapes, ctx.rank
        big = _padded_shape(shapes)
        rows = [s[0] for s in shapes]
        starts = [sum(rows[:r]) for r in range(len(rows))]
        stacked = grad.new_zeros((len(shapes) * big[0], *grad.shape[1:]))
        for r, (start, n) in enumerate(zip(starts, rows)):
            stacked[r * big[0] : r * big[0] + n] = grad[start : start + n]
        mine = _sum_my_block(stacked, rank, big[0])
        return mine[tuple(slice(0, n) for n in shapes[rank])], None, None, None


def _sum_my_block(stacked: torch.Tensor, rank: int, block: int) -> torch.Tensor:
    """Sum over ranks of ``stacked``, keeping only block ``rank`` (W equal blocks along dim 0)."""
    world = stacked.shape[0] // block
    size = stacked.numel() * stacked.element_size()
    global REDUCE_SCATTER
    if REDUCE_SCATTER:
        out = stacked.new_empty((block, *stacked.shape[1:]))
        try:
            issue("reduce_scatter", stacked, lambda: _reduce_scatter(out, stacked),
                  sent=size * (world - 1) // world)
            return out
        except (RuntimeError, NotImplementedError) as e:
            if "not supported" not in str(e).lower() and "not implemented" not in str(e).lower():
                raise
            REDUCE_SCATTER = False  # this backend has none: fall back from now on
    issue("all_reduce", stacked, lambda: dist.all_reduce(stacked), sent=2 * size * (world - 1) // world)
    return stacked[rank * block : (rank + 1) * block]


def _reduce_scatter(out: torch.Tensor, stacked: torch.Tensor) -> None:
    single = getattr(dist, "reduce_scatter_single", None)  # the name from torch 2.13 on
    (single or dist.reduce_scatter_tensor)(out, stacked)


def all_gather_with_grad(x: torch.Tensor, shapes: list[tuple[int, ...]] | None = None, pad_value: float = 0) -> torch.Tensor:
    """Every rank's rows concatenated in rank order (other dims padded as in :func:`all_gather_no_grad`);
    gradients flow back to the rank that owns the rows."""
    rank, world = world_info()
    if world == 1:
        return x
    return _AllGatherWithGrad.apply(x, _shapes_of(x, shapes), rank, pad_value)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks without a gradient path (counts, normalizers, the step's packet)."""
    world = world_info()[1]
    if world == 1:
        return x.detach()
    out = x.detach().clone()
    issue("all_reduce", out, lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM),
          sent=2 * out.numel() * out.element_size() * (world - 1) // world)
    return out


def host_any(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank: an all-reduce of host memory (over gloo), so nothing
    waits for an accelerator. Every rank must call it at the same point."""
    return host_flags(flag)[0]


def host_flags(*flags: bool) -> tuple[bool, ...]:
    """For each flag, whether it is set on any rank: one all-reduce of host memory, as :func:`host_any`."""
    return tuple(v > 0 for v in host_sums(*(int(f) for f in flags)))


def host_sums(*values: int) -> tuple[int, ...]:
    """Each count summed over ranks: one all-reduce of host memory, as :func:`host_any`, so that
    flags and host-side counts (a step's bad samples) ride in the same small exchange."""
    if world_info()[1] == 1:
        return tuple(values)
    t = torch.tensor(values, dtype=torch.int64)
    group = host_group()
    issue("all_reduce", t, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group), sent=8 * len(values))
    return tuple(t.tolist())


def barrier() -> None:
    if world_info()[1] > 1:
        issue("barrier", None, dist.barrier)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (pickled: only for small, trusted metadata)."""
    if world_info()[1] == 1:
        return obj
    box = [obj]
    issue("broadcast", None, lambda: dist.broadcast_object_list(box, src=src))
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (pickled: only for small metadata such as error messages)."""
    world = world_info()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    issue("all_gather", None, lambda: dist.all_gather_object(out, obj))
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
        down while another still has collectives in flight, and the groups are freed: their
        threads are joined here, before the interpreter shuts down (:func:`group_threads` says
        why that matters). The caller has let go of what holds a group (DDP, FSDP2's modules, a
        checkpointer's group). After a failure there is no barrier, the other ranks may never
        arrive, and a worker may wait on a dead peer until the timeout: the groups are left for
        the exit (``vltrain.cli.main``) instead of joined.
        """
        if not is_initialized():
            return
        if clean:
            if self.world_size > 1:
                barrier()
            _HOST_GROUP.clear()
            gc.collect()  # a module's hooks can keep it, and its group, in a reference cycle
        dist.destroy_process_group()

