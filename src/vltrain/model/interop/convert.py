"""What the checkpoint importers share: renaming weights between another library's layout and
vltrain's, checked tensor by tensor, and the preprocessing a checkpoint was trained with.

A :class:`Link` ties one of our tensors to the checkpoint tensors it is made of (several are
concatenated along the first dimension: separate q, k, v projections into our ``qkv``), possibly
transposed (OpenCLIP's projections are matrices applied as ``x @ P``) or reshaped (SigLIP's
``[1]``-shaped temperature). :func:`convert_in` reads a checkpoint through the links and names the
first tensor that is missing, misshapen or left over; :func:`convert_out` writes the other way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vltrain.errors import UserError

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
"""The pixel statistics OpenAI's CLIP (and most OpenCLIP and Hugging Face CLIP checkpoints) use."""


@dataclass
class Preprocessing:
    """How a checkpoint's inputs were prepared: the ``data.*`` values ``model.init`` fills in."""

    image_size: int
    mean: list[float]
    std: list[float]
    resize: str
    """crop (shorter side to image_size, then the centre square) | squash (both sides) | native (the
    image's own aspect ratio, within max_patches)."""
    interpolation: str
    max_text_length: int
    tokenizer: str = ""
    """The checkpoint's own tokenizer.json, if it has one beside it."""
    objective: str = "itc"
    """itc (CLIP's softmax contrastive loss) | siglip (pairwise sigmoid, with a logit bias) | caption
    (a captioner without contrastive parts: the caption loss alone)."""
    max_patches: int = 256
    """resize native: the patch budget per image (SigLIP 2's max_num_patches)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know (a setting read differently, a default assumed)."""


@dataclass(frozen=True)
class Link:
    ours: str
    theirs: tuple[str, ...]
    transpose: bool = False
    shape: tuple[int, ...] | None = None
    """Their shape, where it differs from ours only by dimensions of size 1."""
    patch_hwc: int = 0
    """Theirs is a linear layer over p x p patches flattened (y, x, channel) with this p (SigLIP 2's
    NaFlex patch embedding); ours the same map as a convolution weight [width, 3, p, p]."""


def same(ours: str, theirs: str) -> Link:
    return Link(ours, (theirs,))


def linear(ours: str, theirs: str, bias: bool = True) -> list[Link]:
    """A module's weight (and bias) under another name."""
    return [same(f"{ours}.{p}", f"{theirs}.{p}") for p in (("weight", "bias") if bias else ("weight",))]


def _expected(link: Link, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape each of ``link.theirs`` must have for our tensor of ``shape``."""
    if link.shape is not None:
        return link.shape
    if link.patch_hwc:
        return (shape[0], math.prod(shape[1:]))
    if link.transpose:
        return tuple(reversed(shape))
    return (shape[0] // len(link.theirs), *shape[1:]) if shape else shape


def convert_in(links: list[Link], state: dict[str, torch.Tensor], wanted: dict[str, tuple[int, ...]],
               source: str, arch_from: str) -> dict[str, torch.Tensor]:
    """Our tensors from ``state``, for every link whose tensor the model has (``wanted``: our shapes)."""
    out: dict[str, torch.Tensor] = {}
    for link in links:
        if link.ours not in wanted:
            continue
        shape = tuple(wanted[link.ours])
        expected = _expected(link, shape)
        parts = []
        for key in link.theirs:
            if key not in state:
                raise UserError(f"{source} has no tensor {key!r}, which {link.ours!r} needs: the checkpoint is "
                                "incomplete, or not the kind of model it says it is")
            if tuple(state[key].shape) != expected:
                raise UserError(f"{source}: tensor {key!r} has shape {list(state[key].shape)}, but the architecture "
                                f"{arch_from} needs {list(expected)}")
            parts.append(state[key])
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        if link.patch_hwc:
            p = link.patch_hwc
            t = t.reshape(shape[0], p, p, -1).permute(0, 3, 1, 2)
        out[link.ours] = (t.T if link.transpose else t).reshape(shape).contiguous()
    return out


def leftover(links: list[Link], state: dict[str, torch.Tensor], ignored: tuple[str, ...] = ()) -> list[str]:
    """Checkpoint tensors no link reads (``ignored``: name endings that hold no weights)."""
    used = {k for link in links for k in link.theirs}
    return [k for k in state if k not in used and not k.endswith(ignored)]


def convert_out(links: list[Link], ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their tensors from ours (each its own contiguous copy, as safetensors wants)."""
    out: dict[str, torch.Tensor] = {}
    for link in links:
        t = ours[link.ours].detach().cpu()
        t = t.T if link.transpose else t
        if link.patch_hwc:
            t = t.permute(0, 2, 3, 1).reshape(t.shape[0], -1)
        for key, part in zip(link.theirs, t.chunk(len(link.theirs)) if len(link.theirs) > 1 else (t,)):
            out[key] = (part.reshape(link.shape) if link.shape is not None else part).contiguous().clone()
    return out
