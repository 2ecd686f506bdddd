"""OpenCLIP's CoCa in and out: a small random ``open_clip.CoCa`` saved by open_clip 3.3 itself, with its
outputs on fixed inputs (fixtures/openclip-coca, written by scripts/openclip_coca_reference.py in a
venv where open_clip imports), read by ``model.init`` and written back by ``export --format openclip``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kits.datafiles import run_cli
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from vltrain.errors import UserError
from vltrain.model.builder import build_model
from vltrain.model.config import ModelConfig
from vltrain.model.generate import Decoding, generate
from vltrain.model.interop.openclip_coca import architecture
from vltrain.checkpoint.paths import locate
from vltrain.model.interop.pretrained import describe, load_pretrained
from vltrain.model.passes import direct
from vltrain.model.presets import PRESETS

FIXTURE = Path(__file__).parent / "fixtures" / "openclip-coca"
SOT, EOS, PAD, VOCAB = 1, 2, 0, 300


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


def _load(folder: Path):
    found = locate(folder)
    assert found.kind == "openclip-coca"
    source = describe(found.path, found.kind)
    model = build_model(ModelConfig(preset="", arch=source.arch.to_dict()), vocab_size=VOCAB, pad_id=PAD,
                        mask_id=None, image_size=32, max_text_length=source.arch.text.max_length)
    assert load_pretrained(model, source) == []  # every tensor placed, nothing fresh
    return source, model.eval()


@torch.no_grad()
def _outputs(model, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = ref["ids"]
    mask = (ids != PAD).long()
    tokens, pooled = model.vision(ref["pixels"])
    text_tokens, text_pooled = model.text(ids, mask)
    has_image = torch.ones(len(ids), dtype=torch.bool)
    return {"image_features": F.normalize(model.image_proj(pooled), dim=-1),
            "text_features": F.normalize(model.text_proj(text_pooled), dim=-1),
            "logits": model.caption_logits(text_tokens[:, :-1], mask[:, :-1], tokens, has_image),
            "greedy": generate(direct(model), tokens, [SOT], EOS, PAD, Decoding(max_length=9))}


def _assert_equals_open_clip(out: dict, ref: dict) -> None:
    torch.testing.assert_close(out["image_features"], ref["image_features"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["text_features"], ref["text_features"], atol=1e-5, rtol=0)
    real = ref["ids"][:, :-1] != PAD  # open_clip's logits at padding positions read padding
    torch.testing.assert_close(out["logits"][real], ref["logits"][real], atol=1e-5, rtol=1e-5)
    # open_clip's generate ends every caption with a forced end token at its 10th position
    expected = [[t for t in row[:9] if t != PAD] for row in ref["greedy"].tolist()]
    assert out["greedy"] == expected


def test_an_openclip_coca_folder_gives_open_clips_embeddings_logits_and_captions(reference):
    source, model = _load(FIXTURE)
    assert source.kind == "openclip-coca" and "open_clip_config.json" in source.arch_from
    assert len(reference["ids"][0].nonzero()) == 12  # one caption fills the context: the class token reads itself
    _assert_equals_open_clip(_outputs(model, reference), reference)


def test_a_caption_embeds_the_same_whatever_width_its_batch_is_padded_to(reference):
    """OpenCLIP pads every text to its context length and puts the class token after it; the tower
    pads itself, so a batch padded only to its longest caption (vltrain's collator) gives the same."""
    _, model = _load(FIXTURE)
    ids = reference["ids"][1:]
    n = int((ids != PAD).sum(dim=1).max())
    mask = (ids != PAD).long()
    with torch.no_grad():
        tokens, pooled = model.text(ids, mask)
        narrow_tokens, narrow = model.text(ids[:, :n], mask[:, :n])
    torch.testing.assert_close(narrow, pooled, atol=1e-6, rtol=0)
    torch.testing.assert_close(narrow_tokens, tokens[:, :n], atol=1e-6, rtol=0)


def _user_folder(tmp_path: Path) -> Path:
    """The fixture as a user has it: OpenCLIP's folder with the model's tokenizer.json beside it."""
    folder = tmp_path / "coca"
    shutil.copytree(FIXTURE, folder)
    (folder / "reference.safetensors").unlink()
    words = ["<pad>", "<|startoftext|>", "<|endoftext|>", "<unk>", *(f"w{i}" for i in range(4, VOCAB))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", SOT), ("<|endoftext|>", EOS)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_export_openclip_writes_open_clips_own_tensors_and_config_back(tmp_path, capsys, reference):
    folder = _user_folder(tmp_path)
    code, _, err = run_cli(capsys, "export", str(folder), "--out", str(tmp_path / "out"), "--format", "openclip")
    assert code == 0, err
    theirs = load_file(str(FIXTURE / "open_clip_model.safetensors"))
    ours = load_file(str(tmp_path / "out" / "open_clip_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    written = json.loads((tmp_path / "out" / "open_clip_config.json").read_text())
    given = json.loads((FIXTURE / "open_clip_config.json").read_text())["model_cfg"]
    assert architecture(written["model_cfg"], "out") == architecture(given, "fixture")
    assert written["preprocess_cfg"]["size"] == 32 and written["preprocess_cfg"]["resize_mode"] == "shortest"
    _, model = _load(tmp_path / "out")  # and model.init reads the export back
    _assert_equals_open_clip(_outputs(model, reference), reference)


def test_caption_reads_an_openclip_coca_folder(tmp_path, capsys):
    from PIL import Image

    folder = _user_folder(tmp_path)
    image = tmp_path / "a.png"
    Image.new("RGB", (40, 32), (200, 30, 30)).save(image)
    code, out, err = run_cli(capsys, "caption", str(folder), "--images", str(image), "--max-length", "6")
    assert code == 0, err
    assert str(image) in out and "w" in out.split(str(image), 1)[1]


def test_a_coca_checkpoint_without_its_config_is_refused_in_one_line(tmp_path):
    weights = tmp_path / "open_clip_model.safetensors"
    shutil.copy(FIXTURE / "open_clip_model.safetensors", weights)
    with pytest.raises(UserError, match="model config was not found.*open_clip_config.json"):
        describe(weights, locate(weights).kind)


@pytest.mark.parametrize("change, message", [
    (("vision_cfg", "attentional_pool", "parallel"), "parallel or cascade"),
    (("vision_cfg", "ls_init_value", 0.1), "vision_cfg.ls_init_value = 0.1 is not supported"),
    (("text_cfg", "embed_cls", False), "appended class token"),
])
def test_open_clip_options_vltrain_does_not_compute_are_refused(change, message):
    cfg = json.loads((FIXTURE / "open_clip_config.json").read_text())["model_cfg"]
    part, key, value = change
    cfg[part][key] = value
    with pytest.raises(UserError, match=message):
        architecture(cfg, "ckpt")


def test_the_coca_vit_b32_preset_is_open_clips_coca_vit_b32():
    """OpenCLIP's model_configs/coca_ViT-B-32.json, read as model.init reads it, is the preset, and a
    model of it has open_clip's 253,560,065 parameters (counted with open_clip 3.3)."""
    openclip_config = {
        "embed_dim": 512,
        "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 32, "attentional_pool": True,
                       "attn_pooler_heads": 8, "output_tokens": True},
        "text_cfg": {"context_length": 76, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12,
                     "embed_cls": True, "output_tokens": True},
        "multimodal_cfg": {"context_length": 76, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12,
                           "attn_pooler_heads": 8},
        "custom_text": True,
    }
    assert architecture(openclip_config, "coca_ViT-B-32.json") == PRESETS["coca-vit-b32"]()
    with torch.device("meta"):
        model = build_model(ModelConfig(preset="coca-vit-b32"), vocab_size=49408, pad_id=0, mask_id=None,
                            image_size=224, max_text_length=76)
    assert sum(p.numel() for p in model.parameters()) == 253_560_065


def test_a_model_of_another_structure_is_not_exported_as_openclip(tmp_path, capsys):
    from kits.modelkit import small_model

    from vltrain.config.job import load_config
    from vltrain.export.openclip import check_openclip

    cfg = load_config(None, ["model.preset=tiny-coca"])
    with pytest.raises(UserError, match="lacks an attentional pooler.*export --format native"):
        check_openclip(small_model("tiny-coca"), cfg, "run")
