"""A LoRA run (``train.lora``) out and back in: exported merged in every format (native, hf, openclip)
with the run's embeddings and a config without LoRA; ``export --adapters`` as peft's folder, which
``peft.PeftModel`` puts on the Hugging Face model the run started from with the run's embeddings; and
``train.lora.adapters`` reading that folder into a new run that starts where the first ended and
trains on. Adapters for another base are refused in one line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from kits.datafiles import run_cli  # noqa: E402
from kits.pretrainedkit import TEXTS, image_file, make_clip, make_coca, make_siglip, normalized  # noqa: E402
from kits.runkit import final_state, losses, overrides, session_shapes, train_here  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.config.job import load_config  # noqa: E402
from vltrain.errors import ConfigError, UserError  # noqa: E402
from vltrain.export.adapters import export_adapters  # noqa: E402
from vltrain.export.native import embed, export_model  # noqa: E402
from vltrain.model.interop.peft_adapters import read_adapters  # noqa: E402
from vltrain.types import revise  # noqa: E402

FAMILIES = {"clip": (make_clip, "CLIPModel"), "siglip": (make_siglip, "SiglipModel")}
LORA = {"train__lora__rank": 2, "train__lora__alpha": 4, "train__lora__targets": "[q_proj,v_proj,out_proj,fc1]"}
TOL = 1e-5


def lora_run(shapes: Path, run: Path, init: Path, **extra) -> Path:
    """Two steps of the trainer with rank-2 adapters on q, v, out and fc1 of both towers of ``init``."""
    cfg = load_config(None, overrides(shapes, run, model__init=init, model__preset="''", data__tokenizer="''",
                                      train__max_steps=2, train__lr=1e-2, data__num_workers=0, checkpoint__every=0,
                                      **{**LORA, **extra}))
    train_here(cfg)
    return run


def embeddings(model_path, png: Path) -> np.ndarray:
    opened = open_model(model_path)
    return embed(opened.model, opened.tokenizer, opened.cfg, [png], TEXTS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """A LoRA run from a tiny Hugging Face model; returns (root, run, family, image, the run's embeddings)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    FAMILIES[family][0](root / "pretrained")
    run = lora_run(session_shapes(tmp_path_factory), root / "run", root / "pretrained")
    png = image_file(root / "x.png", seed=7)
    return root, run, family, png, embeddings(run, png)


def hf_embeddings(hf, family: str, processing: Path, png: Path) -> np.ndarray:
    """A transformers model's embeddings of the image and TEXTS, read with the tokenizer and image
    processor of ``processing`` (the run's as ``--format hf`` writes them)."""
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(processing)
    padding = {"padding": "max_length", "max_length": 16} if family == "siglip" else {"padding": True}
    batch = tokenizer(TEXTS, return_tensors="pt", **padding)
    mask = {"attention_mask": batch["attention_mask"]} if family == "clip" else {}
    pixels = transformers.AutoImageProcessor.from_pretrained(processing)(images=Image.open(png), return_tensors="pt")
    with torch.no_grad():
        return np.concatenate([normalized(hf.get_image_features(**pixels)),
                               normalized(hf.get_text_features(input_ids=batch["input_ids"], **mask))])


def test_native_export_is_merged_and_opens_without_the_run(trained, tmp_path):
    root, run, _, png, want = trained
    assert np.abs(embeddings(root / "pretrained", png) - want).max() > 1e-3  # the adapters moved the model
    out = export_model(run, tmp_path / "native")
    saved = load_config(out / "config.yaml")
    assert saved.train.lora.rank == 0 and saved.train.lora.adapters == ""
    assert not any(".lora_" in k or "q_proj" in k for k in load_file(str(out / "model.safetensors")))
    run.rename(root / "moved")  # the export needs neither the run nor its base file
    try:
        np.testing.assert_allclose(embeddings(out, png), want, atol=TOL)
    finally:
        (root / "moved").rename(run)


def test_hf_export_is_merged(trained, tmp_path):
    root, run, family, png, want = trained
    out = export_model(run, tmp_path / "hf", fmt="hf")
    hf = getattr(transformers, FAMILIES[family][1]).from_pretrained(out).eval()
    np.testing.assert_allclose(hf_embeddings(hf, family, out, png), want, atol=TOL)


def test_peft_puts_the_exported_adapters_on_the_hugging_face_base(trained, tmp_path, capsys):
    root, run, family, png, want = trained
    out = tmp_path / "adapters"
    code, stdout, err = run_cli(capsys, "export", str(run), "--adapters", "--out", str(out))
    assert code == 0, err
    assert "adapter_config.json, adapter_model.safetensors" in stdout
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (2, 4, "LORA")
    assert config["base_model_name_or_path"] == str(root / "pretrained")
    assert {t.rpartition(".")[2] for t in config["target_modules"]} == {"q_proj", "v_proj", "out_proj", "fc1"}
    assert len(config["target_modules"]) == 2 * 2 * 4  # both towers, 2 blocks, 4 layers each

    base = getattr(transformers, FAMILIES[family][1]).from_pretrained(root / "pretrained").eval()
    processing = export_model(run, tmp_path / "hf", fmt="hf")  # only for its tokenizer and image processor
    assert np.abs(hf_embeddings(base, family, processing, png) - want).max() > 1e-3
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    np.testing.assert_allclose(hf_embeddings(adapted, family, processing, png), want, atol=TOL)


def test_a_run_from_the_base_and_the_adapters_starts_where_the_first_ended_and_trains_on(trained, tmp_path_factory):
    from vltrain.train.trainer import Trainer

    root, run, _, png, want = trained
    adapters = export_adapters(run, root / "adapters-read")
    cfg = load_config(None, overrides(session_shapes(tmp_path_factory), root / "again", model__init=root / "pretrained",
                                      model__preset="''", data__tokenizer="''", train__max_steps=2, train__lr=1e-2,
                                      data__num_workers=0, checkpoint__every=0, train__lora__adapters=adapters,
                                      **LORA))
    trainer = Trainer(cfg)
    try:
        trainer.model.eval()
        np.testing.assert_allclose(embed(trainer.model, trainer.tokenizer, trainer.cfg, [png], TEXTS), want, atol=TOL)
        trainer.model.train()
        trainer.train()
    finally:
        trainer.close()
    rows = losses(root / "again")
    assert rows and all(np.isfinite(rows))
    read = load_file(str(adapters / "adapter_model.safetensors"))
    ended = {k: v for k, v in final_state(root / "again").items() if k.startswith("model.")}
    assert len(ended) == len(read)
    assert np.abs(embeddings(root / "again", png) - want).max() > 1e-6  # it trained on from them


@pytest.fixture(scope="module")
def coca_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-coca")
    make_coca(root / "coca")
    run = lora_run(session_shapes(tmp_path_factory), root / "run", root / "coca", data__max_text_length=12)
    return run, image_file(root / "x.png", seed=7)


def test_openclip_export_is_merged(coca_run, tmp_path):
    run, png = coca_run
    want = embeddings(run, png)
    assert np.abs(embeddings(run.parent / "coca", png) - want).max() > 1e-3
    out = export_model(run, tmp_path / "openclip", fmt="openclip")
    np.testing.assert_allclose(embeddings(out, png), want, atol=TOL)


# bad input: one line each


@pytest.fixture
def adapted(trained, tmp_path):
    """The clip run's model with its adapters (unmerged), its train.lora and a copy of its adapters."""
    _, run, *_ = trained
    folder = tmp_path / "adapters"
    export_adapters(run, folder)
    opened = open_model(run, merge=False)
    return opened.model, opened.cfg, folder


def _read(adapted, folder: Path | str) -> None:
    model, cfg, _ = adapted
    read_adapters(model, revise(cfg.train.lora, adapters=str(folder)), cfg.model.init)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_tensors(folder: Path, **changes) -> None:
    path = folder / "adapter_model.safetensors"
    save_file({**load_file(str(path)), **changes}, str(path))


Q = "base_model.model.vision_model.encoder.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("trained", ["clip"], indirect=True)
def test_adapters_for_another_base_are_refused_in_one_line(adapted):
    _, _, folder = adapted
    cases = [
        (lambda f: shutil.rmtree(f), ConfigError, r"adapters=.*: no such folder"),
        (lambda f: (f / "adapter_model.safetensors").unlink(), ConfigError, "has no adapter_model.safetensors"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"not tensors"), UserError, "cannot read"),
        (lambda f: _edit_config(f, r=4), ConfigError, r"r 4, and train.lora.rank is 2: set train.lora.rank=4"),
        (lambda f: _edit_config(f, lora_alpha=8), ConfigError, "lora_alpha 8, and train.lora.alpha is 4"),
        (lambda f: _edit_config(f, use_dora=True), ConfigError, "use_dora True; train.lora reads plain LoRA"),
        (lambda f: _edit_config(f, target_modules=["q_proj", "v_proj"]), ConfigError,
         r"target_modules adapt q_proj, v_proj, .* set train.lora.targets=\[q_proj,v_proj\]"),
        (lambda f: _edit_tensors(f, **{f"{Q}.lora_A.weight": torch.zeros(2, 32)}), ConfigError,
         r"q_proj.lora_A.weight is \[2, 32\], and the model's is \[2, 64\]: adapters for another base"),
        (lambda f: _edit_tensors(f, **{f"{Q.replace('layers.0', 'layers.7')}.lora_A.weight": torch.zeros(2, 64)}),
         ConfigError, r"layers.7.self_attn.q_proj.lora_A.weight, and the model has no such layer"),
        (lambda f: _edit_tensors(f, **{f"{Q.replace('q_proj', 'k_proj')}.lora_A.weight": torch.zeros(2, 64)}),
         ConfigError, "adapts vision_model.encoder.layers.0.self_attn.k_proj, which this run does not"),
    ]
    for i, (spoil, kind, message) in enumerate(cases):
        copy = folder.parent / f"case-{i}"
        shutil.copytree(folder, copy)
        spoil(copy)
        with pytest.raises(kind, match=message) as caught:
            _read(adapted, copy)
        assert "\n" not in str(caught.value), caught.value


@pytest.mark.parametrize("trained", ["clip"], indirect=True)
def test_adapters_saved_for_another_path_are_read_and_said_so(adapted, caplog):
    model, cfg, folder = adapted
    _edit_config(folder, base_model_name_or_path="/elsewhere/clip")
    layer = model.vision.blocks[0].attn.qkv.q_proj.lora_B["default"].weight
    want = layer.detach().clone()
    with torch.no_grad():
        layer.zero_()
    with caplog.at_level(logging.INFO, logger="vltrain"):
        _read(adapted, folder)
    assert torch.equal(layer, want)
    said = [r.getMessage() for r in caplog.records if "saved for /elsewhere/clip" in r.getMessage()]
    assert len(said) == 1 and f"model.init is {cfg.model.init}" in said[0]


@pytest.mark.parametrize("trained", ["clip"], indirect=True)
def test_export_adapters_refuses_what_has_none_in_one_line(trained, tmp_path, capsys):
    root, run, *_ = trained
    with pytest.raises(UserError, match=r"has no LoRA adapters \(train.lora.rank is 0\)"):
        export_adapters(root / "pretrained", tmp_path / "a")
    code, _, err = run_cli(capsys, "export", str(run), "--adapters", "--format", "hf", "--out", str(tmp_path / "b"))
    assert code == 2 and "export --adapters writes peft's adapter folder, which has no --format hf" in err
    assert not (tmp_path / "b").exists()


def test_a_fusion_models_adapters_have_no_transformers_model(tmp_path_factory, tmp_path):
    run = tmp_path / "albef"
    cfg = load_config(None, overrides(session_shapes(tmp_path_factory), run, model__preset="tiny-albef",
                                      train__max_steps=1, data__num_workers=0, checkpoint__every=0,
                                      train__lora__rank=2))
    train_here(cfg)
    with pytest.raises(UserError, match="--adapters writes peft adapters .* fusion models") as caught:
        export_adapters(run, tmp_path / "out")
    assert "\n" not in str(caught.value)
