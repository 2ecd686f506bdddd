"""``vltrain train`` with one deliberate change to the math, for showing that the fp64 curve check of
``test_loss_curve.py`` catches it: ``python tests/train/perturbed_run.py CHANGE train CONFIG ...``.

CHANGE is one of:
- ``init-ulp``: every element of the patch embedding's initial weight moved up by one fp32 ulp
  (in an fp64 run too: the smallest change an fp32 initialization can make);
- ``init-ulp-one``: one element of it moved up by one fp32 ulp;
- ``mask``: each native-shape image's last real patch taken for padding (``Images.real``), so masked
  out of the vision tower's attention.
"""

from __future__ import annotations

import sys

import torch


def _nudge(every: bool) -> None:
    import vltrain.compose.opening as opening

    build = opening.build_model_for

    def nudged(*args, **kwargs):
        model = build(*args, **kwargs)
        weight = model.vision.patch_embed.weight
        with torch.no_grad():  # one fp32 ulp, in an fp64 run too
            w32 = weight.float()
            ulp = (torch.nextafter(w32, torch.full_like(w32, float("inf"))) - w32).to(weight.dtype)
            if every:
                weight.add_(ulp)
            else:
                weight.view(-1)[0] += ulp.view(-1)[0]
        return model

    opening.build_model_for = nudged


def _mask_one_fewer() -> None:
    import vltrain.images as images

    def one_fewer(grids: torch.Tensor, length: int) -> torch.Tensor:
        return torch.arange(length, device=grids.device) < (grids[:, 0] * grids[:, 1] - 1).clamp(min=1)[:, None]

    images.real_patches = one_fewer


if __name__ == "__main__":
    change, args = sys.argv[1], sys.argv[2:]
    {"init-ulp": lambda: _nudge(True), "init-ulp-one": lambda: _nudge(False), "mask": _mask_one_fewer}[change]()
    from vltrain.cli.main import main

    sys.argv = ["vltrain", *args]
    sys.exit(main())
