"""model.init from a Hugging Face Siglip2Model (NaFlex) folder: images at their own shape, embedded by
vltrain as transformers' own model embeds what transformers' own image processor makes of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from kits.pretrainedkit import TEXTS, make_siglip2, normalized  # noqa: E402

from vltrain.export.native import embed  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402

# (width, height): aspect ratios 1:4 to 4:1, each at three sizes (small ones are enlarged to the budget)
SHAPES = [(w * k, h * k) for w, h in ((10, 40), (20, 40), (30, 30), (40, 20), (40, 10)) for k in (1, 4, 15)]


def load(init, *overrides):
    opened = open_model(init, list(overrides))
    return opened.model, opened.tokenizer, opened.cfg


@pytest.fixture(scope="module", params=["preprocessor", "processor"])
def siglip2(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip2") / request.param
    hf, processor = make_siglip2(folder, write=request.param)
    return folder, hf, processor, load(folder)


def images(folder, shapes):
    rng = np.random.RandomState(0)
    out = []
    for i, (w, h) in enumerate(shapes):
        # smooth content plus noise: resampling differences would show
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x + y) % 256], -1)
        pixels = np.clip(base + rng.randint(-40, 40, base.shape), 0, 255).astype(np.uint8)
        path = folder / f"img{i}.png"
        Image.fromarray(pixels).save(path)
        out.append(path)
    return out


def test_the_folder_sets_native_shape_and_its_budget(siglip2):
    _, _, _, (model, _, cfg) = siglip2
    assert (cfg.data.resize, cfg.data.max_patches, cfg.data.patch_size) == ("native", 64, 8)
    assert cfg.data.interpolation == "bilinear" and cfg.data.mean == [0.5, 0.5, 0.5]
    assert cfg.model.loss.siglip == 1.0 and cfg.model.loss.itc == 0.0
    assert model.vision.cfg.image_size == 32  # the 4 x 4 position table of 8-pixel patches


def test_image_and_text_embeddings_are_transformers(siglip2, tmp_path):
    _, hf, processor, (model, tokenizer, cfg) = siglip2
    paths = images(tmp_path, SHAPES)
    got = embed(model, tokenizer, cfg, paths, TEXTS, batch_size=7)
    inputs = processor(images=[Image.open(p) for p in paths], return_tensors="pt")
    assert sorted(set(map(tuple, inputs["spatial_shapes"].tolist()))) != [(8, 8)]  # shapes really vary
    ids = torch.tensor([tokenizer.encode(t, 16)[0] + [1] * (16 - len(tokenizer.encode(t, 16)[0])) for t in TEXTS])
    with torch.no_grad():
        want_images = normalized(hf.get_image_features(**inputs))
        want_texts = normalized(hf.get_text_features(input_ids=ids))
    want = np.concatenate([want_images, want_texts])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)


def test_an_image_embeds_the_same_alone_or_in_any_batch(siglip2, tmp_path):
    _, _, _, (model, tokenizer, cfg) = siglip2
    paths = images(tmp_path, SHAPES[:6])
    together = embed(model, tokenizer, cfg, paths, [], batch_size=6)
    alone = np.concatenate([embed(model, tokenizer, cfg, [p], []) for p in paths])
    np.testing.assert_allclose(together, alone, atol=1e-6, rtol=0)


def test_packed_images_embed_as_transformers_embeds_them(siglip2, tmp_path):
    import dataclasses

    _, hf, processor, (model, tokenizer, cfg) = siglip2
    packing = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack_images=True))
    paths = images(tmp_path, SHAPES)
    got = embed(model, tokenizer, packing, paths, [], batch_size=15)
    with torch.no_grad():
        want = normalized(hf.get_image_features(**processor(images=[Image.open(p) for p in paths], return_tensors="pt")))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
