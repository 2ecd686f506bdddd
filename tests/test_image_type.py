"""The image type: which patch positions are real, unpacking and keeping, for every layout."""

from __future__ import annotations

import pickle
from dataclasses import replace

import torch

from vltrain.data.batch import Batch
from vltrain.data.loading.packing import class_slots, layout
from vltrain.images import Images


def packed_images(grids: list[tuple[int, int]], length: int = 8) -> tuple[Images, torch.Tensor]:
    """Packed images of these grids (each patch's values its row, then its index), and the padded patches."""
    sizes = [r * c for r, c in grids]
    places, segments, patch_index = layout(sizes, length)
    padded = torch.zeros(len(grids), length, 3)
    for i, n in enumerate(sizes):
        padded[i, :n] = torch.stack([torch.full((n,), float(i + 1)), torch.arange(n).float(), torch.ones(n)], dim=1)
    pixels = torch.zeros(segments.shape[0], length, 3)
    for i, ((seq, offset), n) in enumerate(zip(places, sizes)):
        pixels[seq, offset:offset + n] = padded[i, :n]
    return Images(pixels, torch.tensor(grids), segments, patch_index, class_slots(places, sizes, segments.shape[0])), padded


def test_each_layout_says_its_layout_positions_and_real_patches():
    square = Images(torch.zeros(2, 3, 32, 32))
    assert (square.layout, len(square), square.positions(8), square.real) == ("square", 2, 16, None)
    padded = Images(torch.zeros(2, 6, 3), torch.tensor([[1, 2], [2, 3]]))
    assert (padded.layout, len(padded), padded.positions(8)) == ("padded", 2, 6)
    assert padded.real.tolist() == [[True, True, False, False, False, False], [True] * 6]
    packed, _ = packed_images([(1, 3), (2, 2), (1, 1)])
    assert packed.layout == "packed" and len(packed) == 3 and packed.pixels.shape[0] < 3
    assert packed.real.sum(dim=1).tolist() == [3, 4, 1]


def test_unpacking_lays_packed_images_out_as_the_padded_layout():
    packed, padded = packed_images([(1, 3), (2, 2), (1, 1), (2, 1)])
    one_per_row = packed.unpacked()
    assert one_per_row.layout == "padded" and torch.equal(one_per_row.pixels, padded)
    assert torch.equal(one_per_row.grids, packed.grids)


def test_the_mask_limited_to_real_patches_and_kept_patches_travel_with_the_rows():
    padded = Images(torch.zeros(3, 4, 3), torch.tensor([[1, 1], [2, 2], [1, 3]]))
    assert padded.among_real(torch.ones(3, 4, dtype=torch.bool)).sum(dim=1).tolist() == [1, 4, 3]
    keep = torch.tensor([[0, 1], [1, 3], [0, 2]])
    rows = padded.kept(keep).index_select(0, torch.tensor([2, 0]))
    assert rows.keep.tolist() == [[0, 2], [0, 1]] and rows.grids.tolist() == [[1, 3], [1, 1]]
    dummy = padded.kept(keep).dummy()
    assert dummy.grids.tolist() == [[1, 1]] and not dummy.pixels.any() and dummy.keep.tolist() == [[0, 1]]
    assert padded.kept(keep).kept(None).keep is None


def test_a_batch_of_packed_images_survives_pickling_whole():
    packed, _ = packed_images([(1, 3), (2, 2), (1, 1)])
    n = len(packed)
    batch = Batch(ids=torch.arange(n), images=packed, has_image=torch.ones(n, dtype=torch.bool),
                  has_text=torch.ones(n, dtype=torch.bool), input_ids=torch.zeros(n, 2, dtype=torch.int64),
                  attention_mask=torch.ones(n, 2, dtype=torch.int64))
    again = pickle.loads(pickle.dumps(batch))
    assert again.tensors().keys() == batch.tensors().keys()
    assert all(torch.equal(a, b) for a, b in zip(again.tensors().values(), batch.tensors().values()))


def test_boxes_travel_with_their_rows_in_every_operation():
    packed, _ = packed_images([(1, 3), (2, 2), (1, 1)])
    boxes = torch.tensor([[[0.0, 0.0, 1.0, 1.0]], [[0.1, 0.2, 0.3, 0.4]], [[0.0, 0.0, 0.0, 0.0]]])
    mask = torch.tensor([[True], [True], [False]])
    with_boxes = replace(packed, boxes=boxes, box_mask=mask)
    rows = with_boxes.unpacked().index_select(0, torch.tensor([1, 2]))
    assert torch.equal(rows.boxes, boxes[1:]) and rows.box_mask.tolist() == [[True], [False]]
    assert set(with_boxes.map(lambda t: t).tensors()) >= {"boxes", "box_mask"}
    assert with_boxes.unpacked().dummy().boxes is None  # a dummy row stands for no image: no regions
