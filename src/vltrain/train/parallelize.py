"""Data parallelism (DDP or FSDP2), activation checkpointing and compilation of a task's model.

What gets wrapped is the :class:`vltrain.objectives.task.Task`: DDP and FSDP2 only see ``forward``, and every
pass of a step (the whole step, or gradient caching's parts) goes through it by name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vltrain.config.job import TrainConfig
from vltrain.objectives.task import Task
from vltrain.runtime.distributed import all_reduce_sum
from vltrain.types import TrainableModel


def compile_blocks(model: TrainableModel, backend: str = "inductor") -> None:
    """``torch.compile`` every transformer block of the towers, in place.

    Blocks, not the whole model: the model picks the rows that have an image (or text) before
    each tower, so a tower's batch size changes from step to step, and the loss code has
    data-dependent branches. A block is a clean graph; with ``dynamic=True`` one compiled graph
    serves every batch size and text length instead of recompiling for each. Blocks of one
    tower share their code, so the first block's compilation serves the others.
    """
    for block in model.blocks_for_sharding():
        block.compile(backend=backend, dynamic=True)


def parallelize(task: Task, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Return the module the trainer calls: the task, wrapped for the process group.

    Order matters: activation checkpointing and compilation act on blocks before sharding,
    so that FSDP2's per-block all-gathers wrap the compiled, checkpointed blocks.
    """
    model = task.model
    if cfg.activation_checkpointing:
        model.set_activation_checkpointing(True)
    if cfg.compile:
        compile_blocks(model)
    wrapped: nn.Module = task
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if cfg.parallelism == "fsdp":
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.fsdp import fully_shard

            # FSDP2 cannot shard 0-dim parameters (the temperature): they stay replicated,
            # and reduce_replicated_grads averages their gradients
            scalars = {p for p in model.parameters() if p.ndim == 0}
            for block in model.blocks_for_sharding():
                fully_shard(block)
            fully_shard(wrapped, ignored_params=scalars)
            wrapped.replicated_params = [p for p in scalars if p.requires_grad]
        return wrapped
    if distributed:
        ids = [device.index] if device.type == "cuda" else None
        # every rank runs every parameter on every step (the model's contract), so the
        # expensive unused-parameter search stays off
        return DistributedDataParallel(wrapped, device_ids=ids, find_unused_parameters=False)
    return wrapped


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, enabled: bool):
    """Inside, a backward all-reduces (reduce-scatters) gradients only if ``enabled``.

    Accumulation turns it off for every micro-batch but the last: one reduction per step.
    """
    if isinstance(wrapped, DistributedDataParallel) and not enabled:
        with wrapped.no_sync():
            yield
        return
    set_sync = getattr(wrapped, "set_requires_gradient_sync", None)
    if set_sync is not None:  # an FSDP2 module
        set_sync(enabled)
    yield


def reduce_replicated_grads(wrapped: nn.Module) -> None:
    """Average over ranks the gradients of parameters FSDP2 left unsharded (after the backward)."""
    params = list(getattr(wrapped, "replicated_params", []))
    if not params or not dist.is_initialized():
        return
    # the same list on every rank: a parameter without a gradient here sends a zero
    flat = torch.stack([p.grad.reshape(()) if p.grad is not None else p.new_zeros(()) for p in params])
    flat = all_reduce_sum(flat) / dist.get_world_size()
    for p, g in zip(params, flat):
        if p.grad is not None:
            p.grad.copy_(g.reshape(p.grad.shape))


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total gradient norm (a plain tensor, also under FSDP2), clipped if ``max_norm`` > 0."""
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in grads], foreach=True)
    full = getattr(norm, "full_tensor", None)  # FSDP2: a partial DTensor until reduced
    if callable(full):
        norm = full()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
    return norm
