"""vltrain export --format hf of a model reading images at their own shape: a Siglip2Model (NaFlex)
folder that transformers' own model, image processor and tokenizer load and embed as vltrain does,
after a fine-tune from a Siglip2Model folder through the real trainer; and the refusals where
transformers would see other images or other tokens than the run did."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from kits.pretrainedkit import make_clip, make_siglip2, normalized  # noqa: E402
from kits.runkit import overrides, session_shapes, train_here  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors  # noqa: E402

from vltrain.config.job import load_config  # noqa: E402
from vltrain.errors import UserError  # noqa: E402
from vltrain.export.hf import hf_family  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.export.native import embed, export_model  # noqa: E402

CAPTIONS = ["a dog", "A CAT", "dog cat a", "a red dog!", "cat dog " * 12]
"""Known and unknown characters, upper case, and one cut at the 16-token limit."""
SHAPES = [(10, 40), (20, 40), (30, 30), (40, 20), (40, 10), (90, 60), (7, 100)]
"""(width, height): 1:4 to 4:1 and beyond; small ones are enlarged to the 64-patch budget."""


def gemma_tokenizer(folder: Path, lowercase: bool = True) -> None:
    """A tokenizer of SigLIP 2's kind, as transformers' Siglip2Tokenizer rebuilds it: Gemma's BPE with
    byte fallback, lower-cased, spaces as "▁"; text then </s>. 16 tokens, the tiny model's vocabulary.
    ``lowercase`` false: cased, as the Gemma tokenizer.json of SigLIP 2 folders on the Hub is."""
    pieces = ["<pad>", "</s>", "<unk>", "▁", "a", "c", "t", "d", "o", "g",
              "ca", "cat", "do", "dog", "▁cat", "▁dog"]
    merges = [("c", "a"), ("ca", "t"), ("d", "o"), ("do", "g"), ("▁", "cat"), ("▁", "dog")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase()] * lowercase + [normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))


def siglip2_folder(folder: Path, lowercase: bool = True):
    """A tiny Siglip2Model with a tokenizer transformers reads as vltrain does (if it lower-cases)."""
    hf, _ = make_siglip2(folder)
    gemma_tokenizer(folder, lowercase)
    return hf


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """Two trainer steps from a tiny Siglip2Model folder; returns (run, original)."""
    root = tmp_path_factory.mktemp("ft-siglip2")
    original = siglip2_folder(root / "pretrained")
    cfg = load_config(None, overrides(session_shapes(tmp_path_factory), root / "run", model__init=root / "pretrained",
                                      data__tokenizer="''", data__mean="[0.4,0.5,0.6]", train__max_steps=2,
                                      data__num_workers=0, checkpoint__every=0))
    train_here(cfg)
    return root / "run", original


def images(folder: Path) -> list[Path]:
    """Smooth gradients plus noise, so a resize done differently would show."""
    rng = np.random.RandomState(0)
    out = []
    for i, (w, h) in enumerate(SHAPES):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1)
        Image.fromarray(np.clip(base + rng.randint(-40, 40, base.shape), 0, 255).astype(np.uint8)).save(
            folder / f"img{i}.png")
        out.append(folder / f"img{i}.png")
    return out


def test_exported_folder_is_a_siglip2_model_with_vltrains_embeddings(finetuned, tmp_path):
    run, original = finetuned
    opened = open_model(run)
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    assert (cfg.data.resize, cfg.data.max_patches, cfg.data.patch_size) == ("native", 64, 8)
    out = export_model(run, tmp_path / "hf", fmt="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "siglip2" and config["architectures"] == ["Siglip2Model"]
    assert config["vision_config"]["num_patches"] == 16 and "image_size" not in config["vision_config"]

    hf, info = transformers.Siglip2Model.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    assert any(not torch.equal(v, original.state_dict()[k]) for k, v in hf.state_dict().items())  # trained

    processor = transformers.AutoImageProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Siglip2ImageProcessorPil"  # torchvision absent: the PIL backend
    assert (processor.max_num_patches, processor.patch_size, processor.resample) == (64, 8, 2)
    assert list(processor.image_mean) == [0.4, 0.5, 0.6]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = hf_tok(CAPTIONS, padding="max_length", truncation=True, return_tensors="pt")
    assert list(texts) == ["input_ids"] and texts["input_ids"].shape == (len(CAPTIONS), 16)  # no mask, as trained
    assert texts["input_ids"][0].tolist()[:3] == tokenizer.encode(CAPTIONS[0], 16)[0]
    assert tokenizer.encode(CAPTIONS[-1], 16)[1]  # the long caption really is cut

    paths = images(tmp_path)
    pixels = processor(images=[Image.open(p) for p in paths], return_tensors="pt")
    assert len(set(map(tuple, pixels["spatial_shapes"].tolist()))) >= 5  # the shapes really vary
    with torch.no_grad():
        want = np.concatenate([normalized(hf.get_image_features(**pixels)),
                               normalized(hf.get_text_features(**texts))])
    got = embed(model, tokenizer, cfg, paths, CAPTIONS, batch_size=5)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_refused_exports_write_nothing_and_say_so_on_one_line(finetuned, tmp_path, cli):
    """The run's checkpoint, its config saying the run kept small images at their own size."""
    import shutil

    run, _ = finetuned
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for saved in copy.rglob("config.yaml"):
        saved.write_text(saved.read_text().replace("upscale: true", "upscale: false"))
    proc = cli("export", copy, "--out", tmp_path / "hf", "--format", "hf")
    assert proc.returncode != 0 and not (tmp_path / "hf").exists()
    assert "data.upscale is false" in proc.stderr and "--format native" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_native_clip_has_no_transformers_equivalent(tmp_path):
    make_clip(tmp_path / "clip")
    opened = open_model(tmp_path / "clip", ["data.resize=native"])
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    with pytest.raises(UserError, match=r"images at their own shape .*\(Siglip2Model needs no class token;") as e:
        hf_family(model, tokenizer, "clip-native", cfg)
    assert "vision pooling map (is cls)" in str(e.value) and "\n" not in str(e.value)


def test_a_tokenizer_transformers_reads_otherwise_is_refused(tmp_path):
    """make_siglip2's word-level tokenizer: Siglip2Tokenizer rebuilds it as a BPE and reads other ids."""
    make_siglip2(tmp_path / "words")
    opened = open_model(tmp_path / "words")
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    with pytest.raises(UserError, match=r"as its Siglip2Tokenizer .* encodes 'a photo of a dog' as \[3, 2, 3, 2, 1"):
        hf_family(model, tokenizer, "words", cfg)
    siglip2_folder(tmp_path / "cased", lowercase=False)  # cased, as the Hub's SigLIP 2 tokenizer.json is
    opened = open_model(tmp_path / "cased")
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    assert cfg.data.text_clean == "lower"  # model.init lower-cases captions, as Siglip2Tokenizer does
    assert hf_family(model, tokenizer, "cased", cfg) == "siglip2"
    opened = open_model(tmp_path / "cased", ["data.text_clean=''"])
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    with pytest.raises(UserError, match=r"encodes 'Two RED circles.*: vltrain's keeps case, and SigLIP 2 reads lower"):
        hf_family(model, tokenizer, "cased", cfg)
    siglip2_folder(tmp_path / "gemma")  # the same model with a tokenizer of SigLIP 2's kind exports
    opened = open_model(tmp_path / "gemma")
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    assert hf_family(model, tokenizer, "gemma", cfg) == "siglip2"


def test_a_siglip2_checkpoint_trains_beside_a_fresh_locca_decoder(tmp_path_factory, tmp_path):
    """model.locca on a SigLIP 2 folder (whose released weights carry no decoder): the decoder starts
    fresh and trains, and the export is still a Siglip2Model transformers loads whole."""
    from vltrain.model.locca import LocCaDecoder

    root = tmp_path_factory.mktemp("locca-siglip2")
    siglip2_folder(root / "pretrained")
    cfg = load_config(None, overrides(session_shapes(tmp_path_factory), root / "run", model__init=root / "pretrained",
                                      model__locca="true", data__tokenizer="''", train__max_steps=2,
                                      data__num_workers=0, checkpoint__every=0))
    assert cfg.model.architecture().decoder.standalone
    train_here(cfg)
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["loss/caption"] > 0 for m in metrics)
    model = open_model(root / "run").model
    assert isinstance(model.decoder, LocCaDecoder)
    out = export_model(root / "run", tmp_path / "hf", fmt="hf")
    _, info = transformers.Siglip2Model.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
