"""Random numbers keyed by what they are for: the run's seed, the optimizer step, the sample and
the position in it. No generator state, no rank, no place in a micro-batch.

The objectives' random choices (MLM masks, MIM masks, ITM negatives) are drawn here, so a sample
gets the same mask in step s whichever rank and micro-batch it lands in, and a run split another
way (other world size, other accumulation) draws the same numbers: the condition for
``data.global_batch_size`` to give the same training math on any number of ranks
(docs/distributed.md#the-global-batch).

The numbers come from a counter-based hash (:func:`vltrain.runtime.hashing.mix32`, applied to the
key's words in turn) computed with int64 tensor arithmetic that never overflows: the same bits on
the CPU and on any GPU, vectorized, with no host synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vltrain.runtime.hashing import MASK32 as _MASK32, mix32


class Stream:
    """Which draw a number is for: two draws of one sample never share a stream."""

    MLM_PICK, MLM_HOW, MLM_TOKEN = 1, 2, 3
    TEXT_MLM_PICK, TEXT_MLM_HOW, TEXT_MLM_TOKEN = 4, 5, 6
    MIM_PATCH = 7
    ITM_TEXT, ITM_IMAGE = 8, 9
    PATCH_KEEP = 10
    LOCCA_REGION, LOCCA_PARALLEL = 11, 12
    GLOBAL_VIEW, LOCAL_VIEW, VIEW_MASK = 13, 14, 15


@dataclass(frozen=True)
class StepKey:
    """What an optimizer step's draws are keyed by; ``totals`` carries the step's objective
    denominators summed over every rank and micro-batch (see ``Objectives.local_totals``)."""

    seed: int
    step: int
    totals: dict[str, torch.Tensor] | None = field(default=None, compare=False)

    def word(self, stream: int) -> int:
        """The 32-bit key of one stream of this step (host arithmetic)."""
        h = mix32((self.seed & _MASK32) ^ 0x9E3779B9)
        h = mix32(h ^ ((self.seed >> 32) & _MASK32))
        h = mix32(h ^ (self.step & _MASK32))
        h = mix32(h ^ ((self.step >> 32) & _MASK32))
        return mix32(h ^ stream)

    def uniform(self, stream: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        """float32 [len(ids), width] in [0, 1): number ``j`` of row ``i`` depends only on the seed, the
        step, ``stream``, ``ids[i]`` and ``j``."""
        k = self.word(stream)
        ids = ids.long()
        h = mix32((ids & _MASK32) ^ k)
        h = mix32(h ^ ((ids >> 32) & _MASK32))
        j = torch.arange(width, device=ids.device, dtype=torch.int64)
        h = mix32(h[:, None] ^ j[None, :])
        h = mix32(h ^ k)
        return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


UNKEYED = StepKey(seed=0, step=0)
"""The key of a pass outside training (evaluation, a direct call): fixed draws."""
