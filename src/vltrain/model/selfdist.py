"""The prototype heads of SigLIP 2's self-distillation (SILC) and masked prediction (TIPS).

Each is DINO's head (Caron et al. 2021, ``DINOHead`` of facebookresearch/dino): an MLP to a small
bottleneck, L2-normalized, then a map to K prototypes whose rows are unit vectors, so that a logit
is a cosine similarity to a prototype. SILC puts one on the pooled image vector, TIPS another on the
patch tokens (iBOT's separate patch head); the teacher's heads are the EMA of these, like the rest
of the teacher. The scoring of their logits lives in :mod:`vltrain.objectives.selfdist`;
docs/objectives.md#self-distillation-silc-and-masked-prediction-tips says what SigLIP 2 leaves open
and what was chosen.

DINO's ``norm_last_layer=True`` is a weight-norm parametrization whose gain is frozen at 1; here it is
the same map written plainly: the prototype matrix is a plain parameter normalized row by row in
``forward``, so a state dict holds one tensor and FSDP2 shards it like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadSettings:
    """A prototype head's sizes. The defaults are DINO's (hidden, bottleneck, layers) and iBOT's
    ViT-B/16 prototype count; SigLIP 2 gives none of them."""

    prototypes: int = 8192
    hidden: int = 2048
    bottleneck: int = 256
    layers: int = 3


class PrototypeHead(nn.Module):
    """Features [..., width] to prototype logits [..., K].

    Parameters: ``mlp`` (``layers`` Linear layers, GELU between, the last to ``bottleneck``), and
    ``prototypes`` ([K, bottleneck], no bias; its rows are normalized in ``forward``, so only their
    directions count). Buffer: ``centre`` [K], the running centre of the teacher's logits that
    :func:`vltrain.objectives.selfdist.updated_centre` moves; kept in checkpoints, and meaningful on
    the teacher's copy of the head (the student's stays as it was made)."""

    def __init__(self, width: int, settings: HeadSettings = HeadSettings()):
        super().__init__()
        sizes = [width] + [settings.hidden] * (settings.layers - 1) + [settings.bottleneck]
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
            if i:
                layers.append(nn.GELU())
            layers.append(nn.Linear(n_in, n_out))
        self.mlp = nn.Sequential(*layers)
        self.prototypes = nn.Parameter(torch.empty(settings.prototypes, settings.bottleneck))
        self.register_buffer("centre", torch.zeros(settings.prototypes))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """DINO's init: normal weights of std 0.02 (``trunc_normal_``, cut at +-2 as DINO cuts them),
        zero biases; the centre at zero."""
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        nn.init.trunc_normal_(self.prototypes, std=0.02)
        self.centre.zero_()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        bottleneck = F.normalize(self.mlp(features), dim=-1)
        return F.linear(bottleneck, F.normalize(self.prototypes, dim=1))


class SelfDistHeads(nn.Module):
    """What SILC and TIPS add to a model: a prototype head on the pooled image vector (``silc``),
    another on the patch tokens (``tips``), and the token a masked patch enters the tower as
    (``mask_token``, TIPS's). Built where ``train.stages`` turn either loss on; before that stage they
    take part in every step with a zero gradient and no weight decay, so they are as they were made
    when their stage starts (:mod:`vltrain.train.staging` starts their optimizer moments there)."""

    def __init__(self, width: int, settings: HeadSettings = HeadSettings()):
        super().__init__()
        self.silc = PrototypeHead(width, settings)
        self.tips = PrototypeHead(width, settings)
        self.mask_token = nn.Parameter(torch.randn(width) * 0.02)

    def anchor(self) -> torch.Tensor:
        """Zero times every parameter: in the graph of a step that scores neither loss, so that DDP and
        FSDP2 see each parameter take part (a zero gradient)."""
        return 0.0 * sum(p.float().sum() for p in self.parameters())
