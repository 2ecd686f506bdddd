"""Mixed precision: which autocast to enter and whether gradients need scaling.

Weights and optimizer state stay fp32; autocast runs matmuls in bf16/fp16. bf16 has fp32's
range, so it needs no loss scaling and works on CPU too. fp16 overflows without a dynamic
loss scale, which only CUDA's GradScaler provides here, so fp16 is refused on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vltrain.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    name: str
    device: torch.device

    def __post_init__(self) -> None:
        if self.name == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.precision: fp16 needs a CUDA device (for gradient scaling); use bf16 on CPU")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A Stateful scaler; disabled (a pass-through) unless fp16."""
        return torch.amp.GradScaler(self.device.type, enabled=self.name == "fp16")
