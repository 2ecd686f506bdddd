import pytest
import torch

from vltrain.data.dataset import Sample
from vltrain.data.loading.collate import Collator


def sample(uid, n_tokens, image=True, truncated=False, errors=()):
    img = torch.full((3, 4, 4), uid, dtype=torch.uint8) if image else None
    return Sample(uid, f"k{uid}", img, list(range(1, n_tokens + 1)), truncated, uid % 2, list(errors))


@pytest.mark.parametrize("lengths, expected", [([3, 5], 8), ([9, 2], 16), ([0, 1], 8), ([30, 40], 20)])
def test_text_is_padded_to_the_longest_row_rounded_to_8_and_capped(lengths, expected):
    b = Collator(pad_id=0, max_text_length=20, images=4)([sample(i + 1, n) for i, n in enumerate(lengths)])
    assert b.input_ids.shape == (2, expected)
    assert b.attention_mask.sum(1).tolist() == [min(n, 20) for n in lengths]


def test_batch_fields():
    samples = [
        sample(1, 3),
        sample(2, 0),  # image-only
        sample(3, 2, image=False, truncated=True, errors=[("bad", "image file not found: x.png")]),
    ]
    b = Collator(pad_id=7, max_text_length=16, images=4)(samples)
    assert b.ids.tolist() == [1, 2, 3] and b.ids.dtype == torch.int64
    assert b.images.pixels.dtype == torch.uint8 and b.images.pixels.shape == (3, 3, 4, 4)
    assert b.images.pixels[0].unique().tolist() == [1]
    assert b.images.pixels[2].unique().tolist() == [0]  # no image: zeros
    assert b.has_image.tolist() == [True, True, False]
    assert b.has_text.tolist() == [True, False, True]
    assert b.input_ids[0].tolist() == [1, 2, 3, 7, 7, 7, 7, 7]
    assert b.input_ids[1].tolist() == [7] * 8 and b.attention_mask[1].sum() == 0
    assert b.attention_mask.dtype == torch.int64
    assert b.source.tolist() == [1, 0, 1]
    assert b.num_truncated == 1
    assert b.errors == [("bad", "image file not found: x.png")]


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return sample(i + 1, i + 1, image=i % 3 != 0, errors=[("k", "bad")] if i == 4 else [])


def test_a_worker_collates_into_one_shared_buffer_that_arrives_as_the_same_batch():
    collate = Collator(pad_id=0, max_text_length=20, images=4)
    expected = [collate([_Samples()[i] for i in range(s, s + 3)]) for s in (0, 3)]
    loader = torch.utils.data.DataLoader(_Samples(), batch_size=3, num_workers=1, collate_fn=collate)
    got = list(loader)
    for g, e in zip(got, expected):
        for name in ("ids", "images.pixels", "has_image", "has_text", "input_ids", "attention_mask", "source"):
            a, b = g.tensors()[name], e.tensors()[name]
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert (g.counts, g.errors, g.num_truncated) == (e.counts, e.errors, e.num_truncated)
        # one buffer for every tensor, shared with the worker that wrote it
        assert len({t.untyped_storage().data_ptr() for t in (g.ids, g.images.pixels, g.input_ids)}) == 1
        assert g.images.pixels.is_shared()
