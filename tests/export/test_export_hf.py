"""vltrain export --format hf: transformers loads the folder (no missing or unexpected keys) and its
embeddings are vltrain's, after a fine-tune from model.init through the real trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kits.modelkit import small_model  # noqa: E402
from kits.pretrainedkit import TEXTS, image_file, make_clip, make_siglip, normalized  # noqa: E402
from kits.runkit import assert_same_recall, overrides, session_shapes, train_here  # noqa: E402

from vltrain.config.job import load_config  # noqa: E402
from vltrain.errors import UserError  # noqa: E402
from vltrain.export.hf import hf_family  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.export.native import embed, export_model  # noqa: E402

FAMILIES = {"clip": (make_clip, "CLIPModel", "CLIPImageProcessor"),
            "siglip": (make_siglip, "SiglipModel", "SiglipImageProcessor")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def finetuned(request, tmp_path_factory):
    """A few steps of the trainer from a tiny random Hugging Face model; returns (run, original, family)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"ft-{family}")
    original = FAMILIES[family][0](root / "pretrained")
    shapes = session_shapes(tmp_path_factory)
    cfg = load_config(None, overrides(shapes, root / "run", model__init=root / "pretrained", data__tokenizer="''",
                                      data__mean="[0.4,0.5,0.6]", train__max_steps=2, data__num_workers=0,
                                      checkpoint__every=0))
    train_here(cfg)
    return root / "run", original, family


def test_a_run_from_model_init_says_and_saves_its_preprocessing(finetuned, capsys, tmp_path):
    run, _, family = finetuned
    saved = load_config(run / "config.yaml")
    pretrained = run.parent / "pretrained"
    assert saved.data.tokenizer == str(pretrained / "tokenizer.json") and saved.data.mean == [0.4, 0.5, 0.6]
    embed_dim = 32 if family == "clip" else 64  # SigLIP's image side has no projection: its width
    assert saved.data.resize == ("crop" if family == "clip" else "squash") and saved.model.arch["embed_dim"] == embed_dim
    assert (saved.model.loss.siglip, saved.model.loss.itc) == ((1.0, 0.0) if family == "siglip" else (0.0, 1.0))
    # what the run built: the checkpoint's architecture, not the default preset; no ITM without its head
    assert saved.model.preset == "" and saved.model.loss.itm == 0.0
    from vltrain.compose.decide import decide, describe_preprocessing

    decided = decide(load_config(None, [f"model.init={pretrained}"]))
    text = describe_preprocessing(decided.cfg, decided.imported)
    assert "32 px" in text and "lower-cased" in text and f"hf-{family}" in text
    assert ("fixed to 16 with id 1" in text) == (family == "siglip")
    # the run's config rebuilds the model without the checkpoint it started from
    pretrained.rename(run.parent / "moved")
    try:
        assert open_model(run).model.embed_dim == embed_dim
    finally:
        (run.parent / "moved").rename(pretrained)


def test_exported_folder_loads_in_transformers_with_vltrains_embeddings(finetuned, tmp_path):
    run, original, family = finetuned
    out = export_model(run, tmp_path / "hf", fmt="hf")
    cls = getattr(transformers, FAMILIES[family][1])
    hf, info = cls.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    changed = [k for k, v in hf.state_dict().items() if not torch.equal(v, original.state_dict()[k])]
    assert changed  # the fine-tune moved the weights: the export is not the starting point

    opened = open_model(run)
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    padding = {"padding": "max_length", "max_length": 16} if family == "siglip" else {"padding": True}
    batch = hf_tok(TEXTS, return_tensors="pt", **padding)
    assert batch["input_ids"][0].tolist()[: len(tokenizer.encode(TEXTS[0], 16)[0])] == tokenizer.encode(TEXTS[0], 16)[0]
    kwargs = {"attention_mask": batch["attention_mask"]} if family == "clip" else {}
    png = image_file(tmp_path / "x.png", seed=7)
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    assert type(processor).__name__.startswith(FAMILIES[family][2])
    from PIL import Image

    with torch.no_grad():
        want_texts = normalized(hf.get_text_features(input_ids=batch["input_ids"], **kwargs))
        want_image = normalized(hf.get_image_features(**processor(images=Image.open(png), return_tensors="pt")))
    got = embed(model, tokenizer, cfg, [png], TEXTS)
    np.testing.assert_allclose(got[1:], want_texts, atol=1e-5)
    np.testing.assert_allclose(got[:1], want_image, atol=1e-4)
    assert json.loads((out / "preprocessor_config.json").read_text())["image_mean"] == [0.4, 0.5, 0.6]


def test_presets_without_a_transformers_equivalent_are_refused():
    with pytest.raises(UserError, match="fusion models"):
        hf_family(small_model("tiny-albef", itm=1.0), None, "tiny-albef")
    with pytest.raises(UserError, match=r"CLIPModel needs causal text attention; text pooling eos \(is mean\)"):
        hf_family(small_model("tiny-clip"), None, "tiny-clip")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("finetuned", ["clip"], indirect=True)  # one family is enough for the command line
def test_cli_exports_hf_and_embeds_and_evaluates_pretrained_folders(finetuned, tmp_path, cli):
    run, _, family = finetuned
    out = tmp_path / "hf"
    proc = cli("export", run, "--out", out, "--format", "hf")
    assert proc.returncode == 0, proc.stderr
    assert "config.json" in proc.stdout and (out / "tokenizer_config.json").is_file()
    png = image_file(tmp_path / "y.png", seed=8)
    proc = cli("embed", out, "--images", png, "--texts", *TEXTS[:2], "--out", tmp_path / "e.npy")
    assert proc.returncode == 0, proc.stderr
    opened = open_model(run)
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), embed(model, tokenizer, cfg, [png], TEXTS[:2]), atol=1e-5)
    shapes = run.parent.parent / "shapes"
    proc = cli("eval", out, "train.threads=1", "data.num_workers=0", "--data", shapes / "val.jsonl", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "in fp32 (an imported checkpoint: fp32 unless train.precision says otherwise)" in proc.stderr
    exported = json.loads(proc.stdout)
    proc = cli("eval", run, "train.threads=1", "data.num_workers=0", "train.precision=fp32", "--data",
               shapes / "val.jsonl", "--json")
    assert proc.returncode == 0, proc.stderr
    assert_same_recall(exported, json.loads(proc.stdout))  # the folder transformers reads is the run
    proc = cli("eval", out, "--data", shapes / "val.jsonl", "train.threads=1", "train.precision=bf16")  # as asked
    assert proc.returncode == 0 and "in bf16 (an imported checkpoint" in proc.stderr, proc.stderr
