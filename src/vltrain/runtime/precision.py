"""Mixed precision: which autocast to enter and whether gradients need scaling.

Weights and optimizer state stay fp32; autocast runs matmuls in bf16/fp16. bf16 has fp32's
range, so it needs no loss scaling. fp16 overflows without a dynamic loss scale: torch's
GradScaler gives one on CUDA and on CPU alike (a CPU multiplies fp16 quickly only with AVX-512
FP16 or AMX-FP16; elsewhere autocast emulates it, as it does bf16 without AVX-512 BF16).

fp64 is for checking the math: weights drawn in fp64, pixels normalized in fp64, every loss and sum
kept there. Its curves agree across CPU kinds to fp64's rounding, where fp32's do not
(``docs/architecture.md#cpu-kinds-and-the-loss-curves``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


@dataclass
class Precision:
    name: str
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @contextlib.contextmanager
    def weights_dtype(self):
        """Build the model inside this: fp32 weights, or for fp64 weights drawn in fp64. Their draws
        then agree across CPU kinds to fp64's rounding; fp32 draws do not (torch's vectorized
        normal and uniform kernels round otherwise than its scalar ones, up to 5e-7 relative)."""
        if self.name != "fp64":
            yield
            return
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(before)

    @property
    def pixel_dtype(self) -> torch.dtype:
        """What images are normalized to: fp32 (autocast casts them where it computes in less), or
        fp64 in an fp64 run."""
        return torch.float64 if self.name == "fp64" else torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name in ("fp32", "fp64"):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A Stateful scaler; disabled (a pass-through) unless fp16."""
        return torch.amp.GradScaler(self.device.type, enabled=self.name == "fp16")


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX-512 BF16 or AMX). Without either,
    bf16 autocast emulates them and runs many times slower than fp32
    (``docs/benchmarks/cpu-training.md#zero-shot-evaluation-speed``). Where the flags cannot be read, True."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return True
    return flags is None or any(flag in flags for flag in BF16_CPU_FLAGS)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 where it is narrower (bf16, fp16), else as it is: what ``x.float()`` does for
    the fp32 and autocast runs, without rounding an fp64 run's values to fp32."""
    return x if x.dtype == torch.float64 else x.float()
