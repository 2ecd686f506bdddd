"""The one door: what a path is (``checkpoint/paths.py``) and opening it (``compose/opening.py``)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from kits.runkit import overrides, session_shapes, train_here

from vltrain.checkpoint.paths import CHECKPOINT, EXPORT, HF, KINDS, OPENCLIP, RUN, find_checkpoint, locate
from vltrain.config.job import load_config
from vltrain.errors import UserError


def _checkpoint(folder):
    folder.mkdir(parents=True)
    (folder / "state.json").write_text("{}")
    (folder / ".metadata").write_bytes(b"")
    return folder


def test_each_kind_of_path_is_told_apart(tmp_path):
    step = _checkpoint(tmp_path / "run" / "checkpoints" / "step-3")
    (tmp_path / "run" / "config.yaml").write_text("checkpoint: {folder: checkpoints}\n")
    export = tmp_path / "export"
    export.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "config.yaml"):
        (export / name).write_text("")
    hf = {}
    for name, config in (("clip", {"model_type": "clip"}), ("siglip", {"model_type": "siglip"}),
                         ("siglip2", {"model_type": "siglip2"}),
                         ("blip", {"model_type": "blip", "architectures": ["BlipForConditionalGeneration"]})):
        hf[name] = tmp_path / f"hf-{name}"
        hf[name].mkdir()
        (hf[name] / "config.json").write_text(json.dumps(config))
    torch.save({"text_projection": torch.zeros(2, 2)}, tmp_path / "open_clip.pt")
    save_file({"text_decoder.ln_final.weight": torch.zeros(2)}, str(tmp_path / "coca.safetensors"))

    assert locate(tmp_path / "run") == locate(str(tmp_path / "run"))
    assert (locate(tmp_path / "run").kind, locate(tmp_path / "run").checkpoint) == (RUN, step)
    assert (locate(step).kind, locate(step).checkpoint) == (CHECKPOINT, step)
    assert (locate(step.parent).kind, locate(step.parent).checkpoint) == (CHECKPOINT, step)
    assert locate(export).kind == EXPORT and locate(export).weights == export / "model.safetensors"
    # the imported kinds, named by what they hold: model.init, eval and the teacher read the same answer
    assert {name: locate(folder).kind for name, folder in hf.items()} == {
        "clip": "hf-clip", "siglip": "hf-siglip", "siglip2": "hf-siglip2", "blip": "hf-blip"}
    assert locate(tmp_path / "open_clip.pt").kind == "openclip"
    assert locate(tmp_path / "coca.safetensors").kind == "openclip-coca"
    assert {locate(hf["blip"]).family, locate(tmp_path / "coca.safetensors").family} == {HF, OPENCLIP}
    assert find_checkpoint(tmp_path / "run") == step
    with pytest.raises(UserError, match="is an exported model .*, not a vltrain run or checkpoint"):
        find_checkpoint(export)


def test_a_run_reads_the_checkpoint_folder_its_config_names(tmp_path):
    step = _checkpoint(tmp_path / "run" / "saved" / "step-1")
    (tmp_path / "run" / "config.yaml").write_text("checkpoint: {folder: saved}\n")
    assert locate(tmp_path / "run").checkpoint == step
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("{}\n")
    with pytest.raises(UserError, match=r"empty is a run folder, but .*checkpoints holds no complete checkpoint"):
        locate(tmp_path / "empty")


@pytest.mark.parametrize("name, why", [("nowhere", "does not exist"), ("notes.txt", "is a file but not a checkpoint"),
                                       ("folder", "holds no complete checkpoint and no model")])
def test_a_bad_path_is_named_with_every_kind_accepted(tmp_path, name, why):
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserError) as e:
        locate(tmp_path / name, role="model.init")
    message = str(e.value)
    assert message.startswith(f"model.init {tmp_path / name} {why}") and "\n" not in message
    assert all(kind in message for kind in KINDS.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_tokenizer_moved_evaluates_embeds_and_exports(tmp_path, tmp_path_factory, cli):
    """The tokenizer saved with the checkpoint is the one every command reads, before data.tokenizer."""
    shapes = session_shapes(tmp_path_factory)
    tokenizer = tmp_path / "tokenizers" / "tokenizer.json"
    tokenizer.parent.mkdir()
    shutil.copy(shapes / "tokenizer.json", tokenizer)
    run = tmp_path / "run"
    train_here(load_config(None, overrides(shapes, run, data__tokenizer=tokenizer, data__val=shapes / "val.jsonl",
                                           train__max_steps=2, data__num_workers=0, checkpoint__every=0,
                                           eval__every=0)))
    evaluate = ("eval", run, "train.threads=1", "eval.batch_size=16", "--json")
    proc = cli(*evaluate)
    assert proc.returncode == 0, proc.stderr
    before = json.loads(proc.stdout)

    tokenizer.rename(tmp_path / "moved.json")
    proc = cli(*evaluate)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == before
    image = shapes / "images" / "val" / "000000.png"
    proc = cli("embed", run, "--images", image, "--texts", "a red circle", "--out", tmp_path / "e.npy")
    assert proc.returncode == 0, proc.stderr
    proc = cli("export", run, "--out", tmp_path / "exported")
    assert proc.returncode == 0, proc.stderr
    proc = cli("embed", tmp_path / "exported", "--images", image, "--texts", "a red circle",
               "--out", tmp_path / "x.npy")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), np.load(tmp_path / "x.npy"))


@pytest.mark.slow
def test_the_commands_name_a_path_they_cannot_open_in_one_line(tmp_path, cli):
    for argv in (["eval", tmp_path / "nowhere"], ["export", tmp_path / "nowhere", "--out", tmp_path / "x"],
                 ["embed", tmp_path / "nowhere", "--texts", "a dog", "--out", tmp_path / "e.npy"]):
        proc = cli(*argv)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and f"{tmp_path / 'nowhere'} does not exist" in proc.stderr


def test_model_init_is_read_once_and_loaded_through_the_door_while_building_loads_nothing(tmp_path, monkeypatch):
    """A run's ``model.init`` of an imported checkpoint: the decide pass describes it once, the door
    fills the run's model with its weights, and the builder alone gives fresh ones."""
    pytest.importorskip("transformers")
    from kits.pretrainedkit import make_clip

    import vltrain.compose.decide as decide_module
    from vltrain.compose.builders import build_model_for
    from vltrain.compose.opening import open_model

    make_clip(tmp_path / "clip")
    described = []
    describe = decide_module.describe
    monkeypatch.setattr(decide_module, "describe", lambda *a, **k: described.append(a[0]) or describe(*a, **k))
    raw = load_config(None, [f"model.init={tmp_path / 'clip'}", "data.batch_size=2"])
    decided = decide_module.decide(raw, 1, "train")
    assert decided.weights.kind == "hf-clip" and decided.imported.kind == "hf-clip" and decided.cfg.train.precision \
        == raw.train.precision  # a run keeps its precision; a model opened to use runs in fp32
    opened = open_model(decided)
    assert described == [tmp_path / "clip"]  # read once: by the pass, not again by the door
    assert opened.model.training and opened.located == decided.weights
    fresh = build_model_for(decided.cfg, opened.tokenizer).state_dict()
    loaded = opened.model.state_dict()
    towers = [k for k in loaded if k.startswith(("vision.", "text.", "image_proj.", "text_proj."))]
    assert towers and not any(torch.equal(fresh[k], loaded[k]) for k in towers if loaded[k].numel() > 1 and
                              loaded[k].float().std() > 0)
    again = open_model(tmp_path / "clip")  # vltrain eval's way in: the same weights, in eval mode, in fp32
    assert not again.model.training and again.cfg.train.precision == "fp32"
    assert all(torch.equal(again.model.state_dict()[k], loaded[k]) for k in towers)
