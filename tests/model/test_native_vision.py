"""The vision tower on images at their own shape: positions resized as SigLIP 2 resizes them, and
an image's embedding that depends on nothing but its own patches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vltrain.images import Images
from vltrain.model.vision import VisionConfig, VisionTransformer, resize_positions

GRIDS = torch.tensor([[4, 4], [2, 8], [8, 2], [3, 5], [1, 16], [5, 3]])


def tower(pooling: str = "map", class_token: bool = False) -> VisionTransformer:
    torch.manual_seed(0)
    cfg = VisionConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, pooling=pooling,
                       class_token=class_token, pre_norm=class_token, patch_bias=not class_token)
    return VisionTransformer(cfg).eval()


def patches(grids: torch.Tensor, length: int = 16, seed: int = 1) -> torch.Tensor:
    """Random patches, zero past each image's grid (what the collator sends)."""
    x = torch.randn(len(grids), length, 3 * 8 * 8, generator=torch.Generator().manual_seed(seed))
    real = torch.arange(length) < grids.prod(-1)[:, None]
    return x * real[..., None]


def test_positions_equal_bilinear_antialiased_resizing_and_transformers():
    table = torch.randn(16 * 16, 24, generator=torch.Generator().manual_seed(0))
    grids = torch.tensor([[16, 16], [8, 32], [3, 85], [20, 12], [1, 256]])
    ours = resize_positions(table, 16, grids, 256)
    square = table.view(16, 16, 24).permute(2, 0, 1)[None]
    for i, (h, w) in enumerate(grids.tolist()):
        want = F.interpolate(square, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
        torch.testing.assert_close(ours[i, : h * w], want[0].permute(1, 2, 0).reshape(h * w, 24), atol=1e-6, rtol=0)
    transformers = pytest.importorskip("transformers.models.siglip2.modeling_siglip2")
    theirs = transformers.Siglip2VisionEmbeddings.resize_positional_embeddings(table.view(16, 16, 24), grids, 256)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("pooling,class_token", [("map", False), ("mean", False), ("cls", True)])
def test_an_image_depends_only_on_its_own_patches(pooling, class_token):
    vit = tower(pooling, class_token)
    x = patches(GRIDS)
    with torch.no_grad():
        _, base = vit(Images(x, GRIDS))
        changed = x.clone()
        changed[0] += 1.0  # another image in the batch
        changed[3, 15:] = 7.0  # the fourth image's padding
        _, after = vit(Images(changed, GRIDS))
    assert not torch.equal(after[0], base[0])
    assert torch.equal(after[1:], base[1:])


def test_padded_and_alone_give_the_same_embedding():
    vit = tower()
    x = patches(GRIDS, length=20)
    with torch.no_grad():
        _, together = vit(Images(x, GRIDS))
        alone = [vit(Images(x[i : i + 1, : int(GRIDS[i].prod())], GRIDS[i : i + 1]))[1] for i in range(len(GRIDS))]
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-6, rtol=0)


def test_the_square_table_grid_is_the_fixed_size_path():
    vit = tower("cls", class_token=True)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    as_patches = images.reshape(2, 3, 4, 8, 4, 8).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 192)
    with torch.no_grad():
        _, fixed = vit(images)
        _, native = vit(Images(as_patches, torch.tensor([[4, 4], [4, 4]])))
    torch.testing.assert_close(native, fixed, atol=1e-5, rtol=0)


def test_gradients_reach_the_table_and_bf16_runs():
    vit = tower().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, pooled = vit(Images(patches(GRIDS), GRIDS))
    pooled.float().square().sum().backward()
    assert pooled.dtype == torch.bfloat16 and vit.pos_embed.grad.abs().sum() > 0


def packed(x: torch.Tensor, grids: torch.Tensor, length: int = 16):
    """The padded patches ``x`` packed as the collator packs them: (pixels, {segments, patch_index,
    slots})."""
    from vltrain.data.loading.packing import class_slots, layout

    sizes = grids.prod(-1).tolist()
    places, segments, patch_index = layout(sizes, length)
    out = torch.zeros(segments.shape[0], length, x.shape[-1])
    for i, (seq, offset) in enumerate(places):
        out[seq, offset:offset + sizes[i]] = x[i, : sizes[i]]
    return out, {"segments": segments, "patch_index": patch_index,
                 "slots": class_slots(places, sizes, segments.shape[0])}


@pytest.mark.parametrize("pooling,class_token", [("map", False), ("mean", False), ("cls", True), ("mean", True),
                                                 ("map", True)])
def test_packed_and_padded_give_the_same_embeddings(pooling, class_token):
    vit = tower(pooling, class_token)
    x = patches(GRIDS)
    small = torch.tensor([[1, 2], [2, 3], [3, 1], [2, 2]])  # four images that share sequences
    grids = torch.cat([GRIDS, small])
    x = torch.cat([x, patches(small, seed=5)])
    pixels, layout = packed(x, grids)
    assert layout["segments"].shape[0] < len(grids) and layout["slots"].shape[1] > 1  # really packed
    with torch.no_grad():
        padded_tokens, padded = vit(Images(x, grids))
        tokens, together = vit(Images(pixels, grids, **layout))
    torch.testing.assert_close(together, padded, atol=1e-6, rtol=0)
    # the tokens come out one image per row, as padded ones do, with the same mask (what the fusion
    # encoder, masked image modelling and evaluation read)
    assert tokens.values.shape == padded_tokens.values.shape and torch.equal(tokens.real, padded_tokens.real)
    real = tokens.real
    assert real.sum() == grids.prod(-1).sum() + class_token * len(grids)
    torch.testing.assert_close(tokens.values[real], padded_tokens.values[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling,class_token", [("map", False), ("cls", True)])
def test_a_packed_image_never_sees_another_images_patches(pooling, class_token):
    vit = tower(pooling, class_token)
    grids = torch.tensor([[2, 3], [1, 4], [2, 2], [1, 2]])  # 6 + 4 + 4 + 2: one sequence of 16
    pixels, layout = packed(patches(grids), grids)
    assert layout["segments"].shape[0] == 1 and layout["slots"].tolist() == [[0, 1, 2, 3]]
    with torch.no_grad():
        _, base = vit(Images(pixels, grids, **layout))
        changed = pixels.clone()
        changed[layout["segments"] == 1] += 3.0
        _, after = vit(Images(changed, grids, **layout))
    assert not torch.equal(after[1], base[1])
    keep = torch.tensor([0, 2, 3])
    assert torch.equal(after[keep], base[keep])


def test_packing_fills_sequences_first_fit_largest_first():
    from vltrain.data.loading.packing import class_slots, first_fit, layout, real_share

    assert first_fit([3, 9, 8, 2, 5], 10) == [(2, 5), (0, 0), (1, 0), (1, 8), (2, 0)]
    places, segments, patch_index = layout([0, 4, 0, 3], 5)
    assert places == [(0, 0), (0, 0), (0, 0), (1, 0)] and segments.tolist() == [[1] * 4 + [-1], [3] * 3 + [-1] * 2]
    assert patch_index[1].tolist() == [0, 1, 2, 0, 0] and real_share(segments) == pytest.approx(0.7)
    _, segments, _ = layout([0, 0], 5)  # no image at all: one sequence of padding
    assert segments.tolist() == [[-1] * 5]
    sizes = [0, 4, 0, 3, 1, 2]  # 4 + 1 in the first sequence, 3 + 2 in the second
    places, segments, _ = layout(sizes, 5)
    assert class_slots(places, sizes, 2).tolist() == [[1, 4], [3, 5]]
    assert class_slots([(0, 0)], [0], 1).tolist() == [[-1]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([6], 5)


def test_the_fusion_encoder_reads_only_an_images_real_tokens():
    """ITM through the fusion encoder (tiny-albef) on images at their own shape: the same whatever
    the padding holds and however long the batch is padded; only the key mask makes it so."""
    from vltrain.model import build_model
    from vltrain.model.config import ModelConfig
    from vltrain.types import Tokens

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-albef"), vocab_size=64, pad_id=0, mask_id=1, image_size=32,
                        max_text_length=8).eval()
    p = model.vision.cfg.patch_size
    grids = torch.tensor([[1, 2], [2, 1], [1, 1]])
    x = torch.randn(3, 4, 3 * p * p, generator=torch.Generator().manual_seed(2))
    x *= (torch.arange(4) < grids.prod(-1)[:, None])[..., None]
    ids = torch.randint(2, 64, (3, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 8, dtype=torch.long)

    def itm(pixels: torch.Tensor, keyed: bool = True) -> torch.Tensor:
        with torch.no_grad():
            tokens, _ = model.vision(Images(pixels, grids))
            tokens = tokens if keyed else Tokens(tokens.values)  # every token taken as real
            return model.itm_head(model.fuse(model.text_tokens(ids, mask), mask, tokens))

    base = itm(x)
    with torch.no_grad():  # the tower's mask: its class token and each image's real patches
        assert model.vision(Images(x, grids))[0].mask.tolist() == [
            [True, True, True, False, False], [True, True, True, False, False], [True, True, False, False, False]]
    garbage = x + 5.0 * (torch.arange(4) >= grids.prod(-1)[:, None])[..., None]  # the padding holds noise
    longer = torch.cat([x, torch.randn(3, 5, 3 * p * p)], dim=1)  # padded to 9 patches, not 4
    torch.testing.assert_close(itm(garbage), base, atol=1e-6, rtol=0)
    torch.testing.assert_close(itm(longer), base, atol=1e-6, rtol=0)
    assert not torch.allclose(itm(longer, keyed=False), base, atol=1e-4)  # without the mask it would move
