"""model.init from a Hugging Face CLIPModel / SiglipModel folder: vltrain's embeddings are transformers'."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vltrain.checkpoint.paths import locate  # noqa: E402
from vltrain.compose.decide import model_config  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402
from kits.pretrainedkit import TEXTS, image_file, make_clip, make_siglip, normalized  # noqa: E402

from vltrain.errors import UserError  # noqa: E402
from vltrain.export.native import embed  # noqa: E402
from vltrain.model.interop.convert import OPENAI_MEAN  # noqa: E402


def load(init, *overrides):
    """The model at ``init`` through the one door, as ``model.init`` and ``vltrain eval`` open it."""
    opened = open_model(init, list(overrides))
    return opened.model, opened.tokenizer, opened.cfg


def padded(tokenizer, texts, length=None, pad_id=None):
    rows = [tokenizer.encode(t, 16)[0] for t in texts]
    n = length or max(map(len, rows))
    ids = torch.full((len(rows), n), tokenizer.pad_id if pad_id is None else pad_id)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


@pytest.fixture(scope="module", params=["modern", "legacy-eos", "gelu"])
def clip(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip") / request.param
    hf = make_clip(folder, legacy_eos=request.param == "legacy-eos",
                   hidden_act="gelu" if request.param == "gelu" else "quick_gelu")
    return folder, hf, load(folder)


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip") / "siglip"
    hf = make_siglip(folder)
    return folder, hf, load(folder)


def test_clip_text_embeddings_are_transformers(clip):
    _, hf, (model, tokenizer, cfg) = clip
    got = embed(model, tokenizer, cfg, [], TEXTS)
    ids, mask = padded(tokenizer, TEXTS)
    with torch.no_grad():
        want = normalized(hf.get_text_features(input_ids=ids, attention_mask=mask))
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-5, rtol=0)


def test_clip_image_embeddings_are_transformers(clip, tmp_path):
    folder, hf, (model, tokenizer, cfg) = clip
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model._vision(pixels)[-1].numpy()
        want = normalized(hf.get_image_features(pixel_values=pixels))
    torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(want), atol=1e-5, rtol=0)

    # through vltrain's own image pipeline and transformers' image processor
    from PIL import Image

    png = image_file(tmp_path / "a.png")
    got = embed(model, tokenizer, cfg, [png], [])
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    with torch.no_grad():
        want = normalized(hf.get_image_features(**processor(images=Image.open(png), return_tensors="pt")))
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-4, rtol=0)


def test_clip_preprocessing_follows_the_checkpoint_unless_set(clip):
    folder, _, (model, _, cfg) = clip
    d = cfg.data
    assert (d.image_size, d.resize, d.interpolation, d.max_text_length) == (32, "crop", "bicubic", 16)
    assert d.mean == OPENAI_MEAN and d.tokenizer == str(folder / "tokenizer.json")
    assert cfg.model.arch["text"]["causal"] and cfg.model.arch["vision"]["act"] in ("quick_gelu", "gelu")
    assert model.logit_bias is None and cfg.model.loss.itc == 1.0
    mine = model_config(locate(folder), ["data.mean=[0.5,0.5,0.5]", "data.max_text_length=8"]).cfg
    assert mine.data.mean == [0.5, 0.5, 0.5] and mine.data.max_text_length == 8 and mine.data.std == d.std
    saved = model_config(locate(folder), ["data.interpolation=bilinear"]).cfg
    assert "interpolation: bilinear" in saved.to_yaml() and "image_size: 32" in saved.to_yaml()


def test_siglip_embeddings_are_transformers(siglip, tmp_path):
    folder, hf, (model, tokenizer, cfg) = siglip
    assert cfg.model.loss.siglip == 1.0 and cfg.model.loss.itc == 0.0
    assert cfg.data.resize == "squash" and cfg.data.mean == [0.5, 0.5, 0.5] and cfg.data.max_text_length == 16
    got = embed(model, tokenizer, cfg, [], TEXTS)
    ids, _ = padded(tokenizer, TEXTS, length=16, pad_id=1)  # SigLIP: fixed-length, padded with </s>
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = normalized(hf.get_text_features(input_ids=ids))
        ours = model._vision(pixels)[-1].numpy()
        want_images = normalized(hf.get_image_features(pixel_values=pixels))
        assert float(model.logit_bias) == pytest.approx(float(hf.logit_bias))
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(want_images), atol=1e-5, rtol=0)

    from PIL import Image

    png = image_file(tmp_path / "b.png", seed=3)
    got = embed(model, tokenizer, cfg, [png], [])
    processor = transformers.SiglipImageProcessor.from_pretrained(folder)
    with torch.no_grad():
        want = normalized(hf.get_image_features(**processor(images=Image.open(png), return_tensors="pt")))
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), atol=1e-4, rtol=0)


def _rewrite(src, dst, change):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    change(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_a_missing_or_misshapen_tensor_is_named(siglip, tmp_path):
    folder = siglip[0]
    key = "text_model.encoder.layers.1.mlp.fc2.bias"
    gone = _rewrite(folder, tmp_path / "gone", lambda s: s.pop(key))
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        load(gone)
    key = "vision_model.head.attention.in_proj_weight"
    bent = _rewrite(folder, tmp_path / "bent", lambda s: s.__setitem__(key, s[key][:-1]))
    with pytest.raises(UserError, match=rf"{key.replace('.', '[.]')}.*\[191, 64\].*\[192, 64\]"):
        load(bent)
    extra = _rewrite(folder, tmp_path / "extra", lambda s: s.__setitem__("vision_model.extra.weight", s[key].clone()))
    with pytest.raises(UserError, match="vision_model.extra.weight"):
        load(extra)


def test_legacy_pytorch_model_bin_loads_and_code_is_refused(siglip, tmp_path):
    import os
    import shutil

    from safetensors.torch import load_file

    folder, hf, (model, _, _) = siglip
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    torch.save(load_file(str(legacy / "model.safetensors")), legacy / "pytorch_model.bin")
    (legacy / "model.safetensors").unlink()
    again = load(legacy)[0]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    class Payload:
        def __reduce__(self):
            return os.system, ("echo owned",)

    torch.save({"state_dict": {"w": torch.zeros(1)}, "payload": Payload()}, legacy / "pytorch_model.bin")
    with pytest.raises(UserError, match="refused"):
        load(legacy)
