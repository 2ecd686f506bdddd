"""Counting the operations that make the host wait for the device.

On a GPU each of these blocks the Python thread until the device has caught up, so the next
batch's copy and the next kernels cannot be queued ahead: a step with none of them runs at the
speed of its kernels. On a CPU nothing waits, but the same operations run, so a test on a CPU
proves a step free of them for every device. (Of the copies to the host, a CPU run sees none:
there ``.tolist()`` on a CPU tensor reads host memory; on CUDA they are counted too.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_ALWAYS = {
    _aten._local_scalar_dense.default: "item",  # .item(), bool(t), int(t), float(t)
    _aten.is_nonzero.default: "is_nonzero",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.equal.default: "equal",
}
_COPIES = (_aten._to_copy.default, _aten.copy_.default)


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy from an accelerator to the CPU (``.cpu()``, ``.tolist()``): it waits for the device."""
    if func not in _COPIES:
        return False
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"


def _bool_index(func: Any, args: tuple) -> bool:
    """``t[mask]`` and ``t[mask] = v`` with a boolean mask: the result's size is data-dependent."""
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as c: ...`` counts, in ``c.counts``, each sync-forcing op run."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _ALWAYS.get(func)
        if name is None and _bool_index(func, args):
            name = "boolean index"
        if name is None and _to_host(func, args, kwargs):
            name = "copy to host"
        if name is not None:
            self.counts[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
