"""Parameters and training FLOPs per sample of every model preset, at its reference sizes.

Built on the meta device (no memory, instant). FLOPs are analytic (3 x forward matmul FLOPs), the
figure MFU is computed from. Usage: python benchmarks/model_presets.py
"""

from __future__ import annotations

import torch

from vltrain.model import build_model, list_presets
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.objectives.scoring import Objectives

REFERENCE = {  # vocab, text length, image size
    "tiny-clip": (1000, 32, 64),
    "tiny-albef": (1000, 32, 64),
    "clip-vit-b32": (49408, 77, 224),
    "clip-vit-b16": (49408, 77, 224),
    "clip-vit-l14": (49408, 77, 224),
    "albef-base": (30522, 30, 256),
}


def main() -> None:
    print(f"{'preset':<14} {'objectives':<16} {'image':>5} {'text':>4} {'params (M)':>11} {'train GFLOP/sample':>19}")
    for name in list_presets():
        vocab, length, image = REFERENCE[name]
        fusion = name.endswith("albef") or name == "albef-base"
        losses = [LossConfig()] + ([LossConfig(mlm=1.0)] if fusion else [])
        for loss in losses:
            with torch.device("meta"):
                model = build_model(ModelConfig(preset=name, loss=loss), vocab_size=vocab, pad_id=0, mask_id=1,
                                    image_size=image, max_text_length=length)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            objectives = "+".join(Objectives(loss, model.spec).loss_weights)
            print(f"{name:<14} {objectives:<16} {image:>5} {length:>4} {params:>11.2f} {model.flops_per_sample() / 1e9:>19.2f}")


if __name__ == "__main__":
    main()
