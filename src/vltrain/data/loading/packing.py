"""Packing images at their own shape into sequences: the packed layout of
:func:`vltrain.data.image_input.image_layout`.

Padded, each image takes a whole sequence of ``data.max_patches`` positions however few patches it
has: a 3:1 panorama at a 256-patch budget is 9 x 27 = 243 patches, a 1:4 receipt 8 x 32 = 256, but a
thumbnail left at its own size (``data.upscale: false``) may be 20. Packed, the collator places the
batch's images into as few sequences of that length as it can (first fit, largest first), and the
model keeps attention inside each image (block-diagonal), so an image embeds as it would alone. A
tower with a class token gives each packed image one more position, before its sequence's patches
(``class_slots``). The layout is computed here, on the host, in the loader's workers: the model only gathers by it, with
no host synchronization.
"""

from __future__ import annotations

import torch


def first_fit(sizes: list[int], length: int) -> list[tuple[int, int]]:
    """``(sequence, offset)`` for each item of ``sizes``: the largest first, each into the first
    sequence of ``length`` positions with room for it, a new one when none has. Ties keep the
    items' order, so a batch always packs the same way."""
    free: list[int] = []
    place = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if sizes[i] > length:
            raise ValueError(f"an image of {sizes[i]} patches does not fit a sequence of {length}")
        seq = next((s for s, room in enumerate(free) if room >= sizes[i]), len(free))
        if seq == len(free):
            free.append(length)
        place[i] = (seq, length - free[seq])
        free[seq] -= sizes[i]
    return place


def layout(sizes: list[int], length: int) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """The places of images of ``sizes`` patches (0: no image), and the packed layout:
    ``segments`` [S, length], the image each position holds (-1: padding), and ``patch_index``
    [S, length], the patch of that image it holds (0 on padding). At least one sequence, so a
    batch without images still gives the tower something to run on."""
    present = [i for i, n in enumerate(sizes) if n]
    placed = first_fit([sizes[i] for i in present], length)
    count = max([s for s, _ in placed], default=0) + 1
    segments = torch.full((count, length), -1, dtype=torch.int64)
    patch_index = torch.zeros((count, length), dtype=torch.int64)
    place = [(0, 0)] * len(sizes)
    for i, (seq, offset) in zip(present, placed):
        n = sizes[i]
        segments[seq, offset:offset + n] = i
        patch_index[seq, offset:offset + n] = torch.arange(n)
        place[i] = (seq, offset)
    return place, segments, patch_index


def class_slots(places: list[tuple[int, int]], sizes: list[int], sequences: int) -> torch.Tensor:
    """[S, K]: the images (rows) each packed sequence holds, in the order they lie in it, -1 past
    its last; K is the most any sequence holds (at least 1). A tower with a class token puts one
    class token per image in these K positions before the sequence's patches."""
    held: list[list[int]] = [[] for _ in range(sequences)]
    for i in sorted((i for i, n in enumerate(sizes) if n), key=lambda i: places[i]):
        held[places[i][0]].append(i)
    slots = torch.full((sequences, max(1, *map(len, held))), -1, dtype=torch.int64)
    for seq, rows in enumerate(held):
        slots[seq, :len(rows)] = torch.tensor(rows, dtype=torch.int64)
    return slots


def real_share(segments: torch.Tensor) -> float:
    """The share of a packed (or padded) batch's positions that hold a real patch."""
    return float((segments >= 0).float().mean())
