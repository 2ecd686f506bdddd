"""Data parallelism (DDP or FSDP2), activation checkpointing and compilation of a task's model.

What gets wrapped is the :class:`vltrain.compose.task.Task`: DDP and FSDP2 only see ``forward``, and every
pass of a step (the whole step, or gradient caching's parts) goes through it by name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vltrain.config.job import TrainConfig
from vltrain.runtime.distributed import all_reduce_sum
from vltrain.compose.task import Task
from vltrain.types import TrainableModel


def compile_blocks(model: TrainableModel, backend: str = "inductor") -> None:
    """``torch.compile`` every transformer block of the towers, in place: what FSDP2 needs, whose
    all-gathers run between blocks. ``dynamic=True``: one graph serves every batch size and text
    width; blocks of one tower share their code, so the first block's compilation serves the rest.
    """
    for block in model.blocks_for_sharding():
        block.compile(backend=backend, dynamic=True)


def compile_towers(model: TrainableModel, backend: str = "inductor") -> None:
    """``torch.compile`` each tower whole, in place: embeddings, blocks and final norm in one graph
    (a tower traces without a break: tests/model/test_tower_graphs.py), so the norms, the patch
    embedding and the residual adds between blocks fuse too.

    Shapes are left to dynamo's automatic dynamism: a tower is compiled for its first shapes and
    once more, with the dimension that changed (a text width, or a tower's rows under mixed
    modalities) marked dynamic. Fixed batching with one modality keeps every shape static.
    The model code outside the towers (picking each tower's rows, the losses) stays eager.
    """
    for tower in (model.vision, model.text, model.fusion, getattr(model, "decoder", None)):
        if tower is not None:
            tower.compile(backend=backend)


def parallelize(task: Task, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Return the module the trainer calls: the task, wrapped for the process group.

    Order matters: activation checkpointing and compilation act before sharding, so that FSDP2's
    per-block all-gathers wrap the compiled, checkpointed blocks. ``train.compile`` compiles whole
    towers, except under FSDP, whose per-block hooks need the blocks as the compiled units.
    """
    model = task.model
    if cfg.activation_checkpointing:
        model.set_activation_checkpointing(True)
    if cfg.compile:
        (compile_blocks if cfg.parallelism == "fsdp" else compile_towers)(model)
    wrapped: nn.Module = task
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if cfg.parallelism == "fsdp":
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # FSDP2's own default mesh, made here so that the end of the run can let its groups
            # go (vltrain.runtime.distributed.release_mesh)
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            # FSDP2 cannot shard 0-dim parameters (the temperature): they stay replicated,
            # and reduce_replicated_grads averages their gradients
            replicated = _replicated(model, cfg)
            for block in model.blocks_for_sharding():
                fully_shard(block, mesh=mesh)
            fully_shard(wrapped, mesh=mesh, ignored_params=set(replicated))
            wrapped.replicated_params = [p for p in replicated if p.requires_grad]
            wrapped.device_mesh = mesh
        return wrapped
    if distributed:
        ids = [device.index] if device.type == "cuda" else None
        replicated = _replicated(model, cfg, scalars=False)
        if replicated:
            names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapped, [names[id(p)] for p in replicated])
        # every rank runs every parameter on every step (the model's contract), so the
        # expensive unused-parameter search stays off
        ddp = DistributedDataParallel(wrapped, device_ids=ids, find_unused_parameters=False)
        ddp.replicated_params = [p for p in replicated if p.requires_grad]
        return ddp
    return wrapped


def _replicated(model: nn.Module, cfg: TrainConfig, scalars: bool = True) -> list[nn.Parameter]:
    """The parameters kept whole on every rank, outside DDP's and FSDP2's reduction, in the model's
    order (the same on every rank): FSDP2 cannot shard the 0-dim ones (the temperature); and the
    vision tower's position table where a stage changes the image size, which resizes it
    (:mod:`vltrain.train.resizing`). :func:`reduce_replicated_grads` averages their gradients."""
    resized = any(s.image_size is not None for s in cfg.stages)
    table = getattr(getattr(model, "vision", None), "pos_embed", None) if resized else None
    return [p for p in model.parameters() if (scalars and p.ndim == 0) or p is table]


def task_of(wrapped: nn.Module) -> Task:
    """The :class:`~vltrain.compose.task.Task` that ``wrapped`` (from :func:`parallelize`) runs."""
    return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped


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
    """Average over ranks the gradients of the parameters kept outside DDP's and FSDP2's reduction
    (:func:`_replicated`; after the backward)."""
    params = list(getattr(wrapped, "replicated_params", []))
    if not params or not dist.is_initialized():
        return
    # the same list on every rank: a parameter without a gradient here sends zeros
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    flat = all_reduce_sum(flat) / dist.get_world_size()
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is not None:
            p.grad.copy_(g.reshape(p.grad.shape))


def apart_from_shards(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` as DTensor's operators take them: where some are FSDP2's shards, the whole ones of
    more than one dimension (a position table a stage resizes: :func:`_replicated`) in a list of their
    own after the rest, which DTensor's operators do not mix with them (0-dim ones mix: DTensor
    replicates them implicitly); elsewhere one list."""
    if not any(hasattr(p, "full_tensor") for p in params):
        return [params]
    rest = [p for p in params if p.ndim == 0 or hasattr(p, "full_tensor")]
    whole = [p for p in params if p.ndim > 0 and not hasattr(p, "full_tensor")]
    return [part for part in (rest, whole) if part]


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Total gradient norm (a plain tensor, also under FSDP2), clipped if ``max_norm`` > 0; whole
    parameters beside FSDP2's shards normed and clipped apart (:func:`apart_from_shards`)."""
    groups = apart_from_shards([p for p in params if p.grad is not None])
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        full = getattr(norm, "full_tensor", None)  # FSDP2: a partial DTensor until reduced
        norms.append(full() if callable(full) else norm)
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm
