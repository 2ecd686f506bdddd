"""Text longer than an imported checkpoint's context: its text position table stretched (Long-CLIP).

Long-CLIP (Zhang et al., 2024, arXiv 2403.15378) gives CLIP 248 positions instead of 77 without
retraining from scratch: the first 20 rows of the table, which pre-training trained well, are kept
as they are, and the remaining ones are spread four times as far apart, each new row interpolated
linearly between the two old rows around it, the last few extrapolated along the last old step. A
caption of at most 20 tokens is then read exactly as the checkpoint read it (a causal tower sees
only the positions up to its end token), and a longer one gets positions the model already knows
the neighbourhood of, which a short fine-tune on long captions then adapts.

:func:`stretch_positions` generalises the ratio: new row ``n`` (from ``keep`` on) sits at old
position ``keep + (n - keep) x (old - keep) / (new - keep)``, a fraction of the way from the old
row below it to the one above (past the last old row: along the last step). At Long-CLIP's sizes
(77 -> 4 x 77 - 3 x 20 = 248, keep 20) that is its table, computed with its own arithmetic
(``(4 - j) x a / 4 + j x b / 4``), so bit for bit; at any whole ratio the same rule with that ratio.
The one table replaces Long-CLIP's two (its kept rows and its stretched rows are separate
parameters that sum to this table and get the same gradients).

Only towers whose embedding of a short caption does not depend on the table's length keep that
promise: CLIP's, which reads the caption's own positions. SigLIP's text tower pads every caption to
its full length and pools the last position, and OpenCLIP's CoCa appends its class token after the
full length: a longer table changes every caption's embedding, so they are refused
(:func:`check_stretch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vltrain.errors import ConfigError
from vltrain.model.text import TextTowerConfig

STRETCHABLE = ("hf-clip", "openclip")
"""The imported kinds whose text position table may be stretched: CLIP's text towers."""
KEY = "model.text.stretch_keep"


@dataclass(frozen=True)
class Stretch:
    """A checkpoint's text position table of ``old`` rows read as ``new`` rows, the first ``keep``
    as they are."""

    old: int
    new: int
    keep: int

    def apply(self, table: torch.Tensor) -> torch.Tensor:
        return stretch_positions(table, self.new, self.keep)

    def describe(self) -> str:
        return (f"text positions stretched from {self.old} to {self.new} (Long-CLIP: the first {self.keep} kept, "
                f"{KEY}; the rest interpolated)")


def stretch_positions(table: torch.Tensor, new: int, keep: int) -> torch.Tensor:
    """``table`` [old, W] stretched to [new, W]: rows below ``keep`` copied, the others interpolated
    (the module's rule); float32 arithmetic for lower-precision tables, the table's own otherwise."""
    old = table.shape[0]
    if not 0 <= keep < old or new <= old or old < 2:
        raise ValueError(f"cannot stretch {old} positions to {new} keeping {keep}")
    src = table.float() if table.dtype in (torch.float16, torch.bfloat16) else table
    span, new_span = old - keep, new - keep
    g = math.gcd(span, new_span)
    ratio = new_span // g  # the step between new rows is span / new_span = (span // g) / ratio old rows
    offset = torch.arange(new_span) * (span // g)
    base, frac = keep + torch.div(offset, ratio, rounding_mode="floor"), offset % ratio
    out = torch.empty(new, table.shape[1], dtype=src.dtype)
    out[:keep] = src[:keep]
    inner = base < old - 1
    a, b = src[base[inner]], src[base[inner] + 1]
    w = frac[inner].to(src.dtype)[:, None]
    out[keep:][inner] = torch.where(w == 0, a, (ratio - w) * a / ratio + w * b / ratio)
    last, step = src[old - 1], src[old - 1] - src[old - 2]
    w = frac[~inner].to(src.dtype)[:, None]
    out[keep:][~inner] = last + w * step / ratio
    return out.to(table.dtype)


def check_stretch(text: TextTowerConfig, kind: str, length: int, keep: int, where: str) -> Stretch:
    """The stretch of ``where``'s text positions (a checkpoint of ``kind``) to ``length``
    (``data.max_text_length``), or one line saying why it cannot be."""
    old = text.max_length
    ask = f"data.max_text_length {length} exceeds {where}'s {old} text positions"
    if text.pad_to_max_length or text.pooling in ("last", "appended"):
        raise ConfigError(f"{ask}, and its text tower pads every caption to its full length (reading the last "
                          "position, or a class token after it), so a longer table would change every caption's "
                          f"embedding; set data.max_text_length to at most {old}")
    if kind not in STRETCHABLE:
        raise ConfigError(f"{ask}; stretching the table (Long-CLIP, {KEY}) is for CLIP text towers (a Hugging Face "
                          f"CLIPModel, an OpenCLIP CLIP), not {kind}; set data.max_text_length to at most {old}")
    if keep >= old:
        raise ConfigError(f"{KEY} {keep}: the positions kept as they are must be fewer than {where}'s {old} "
                          f"(Long-CLIP keeps 20 of 77), so that some are stretched to data.max_text_length {length}")
    return Stretch(old, length, keep)
