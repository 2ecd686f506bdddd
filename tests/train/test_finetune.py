"""The fine-tuning recipe: configs/finetune-clip.yaml, and a tiny run through layer decay, a frozen
tower with its last block unlocked, the saved initial weights and `vltrain export --interpolate`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kits.runkit import final_state, overrides, session_shapes, train_here
from safetensors.torch import load_file

from vltrain.checkpoint.manager import INITIAL_FILE
from vltrain.config.job import load_config
from vltrain.errors import UserError

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "finetune-clip.yaml"


def test_recipe_loads_with_the_users_overrides():
    cfg = load_config(RECIPE, ["model.init=/models/clip-vit-b32", "data.train=my/train.jsonl"])
    assert cfg.model.init == "/models/clip-vit-b32" and cfg.model.preset == "clip-vit-b32"
    tc = cfg.train
    assert tc.lr <= 1e-4 and tc.warmup_steps > 0 and 0.6 <= tc.layer_decay <= 0.8
    assert cfg.checkpoint.save_initial == "auto"

    locked = load_config(RECIPE, ["model.init=/m", "data.train=t.jsonl", "train.freeze=[vision]",
                                  "train.unlock_last=2"])
    assert locked.train.freeze == ["vision"] and locked.train.unlock_last == 2


def test_recipes_optimizer_on_the_preset():
    """The recipe's layer decay and a locked image tower with 2 blocks unlocked, on ViT-B/32 (meta device)."""
    from vltrain.model import build_model
    from vltrain.train.optim import build_optimizer, freeze_towers

    cfg = load_config(RECIPE, ["model.init=/m", "data.train=t.jsonl", "train.freeze=[vision]", "train.unlock_last=2"])
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size=49408, pad_id=0, mask_id=None, image_size=224, max_text_length=77)
    freeze_towers(model, cfg.train.freeze, cfg.train.unlock_last)
    opt = build_optimizer(model, cfg.train)
    lr = {n: g["lr"] for g in opt.param_groups for n, p in model.named_parameters() if any(p is q for q in g["params"])}
    d = cfg.train.layer_decay

    def lrs(prefix: str) -> set[float]:
        return {v for n, v in lr.items() if n.startswith(prefix)}

    assert lrs("vision.blocks.11.") == {1e-5 * d}
    assert lrs("vision.blocks.10.") == {1e-5 * d**2}
    assert lrs("vision.") - lrs("vision.blocks.") == {1e-5}  # the final norm: the rest is frozen
    assert not lrs("vision.blocks.9.") and "vision.patch_embed.weight" not in lr
    assert lrs("text.blocks.0.") == {1e-5 * d**12}
    assert lr["text.token_embedding.weight"] == pytest.approx(1e-5 * d**13)
    assert lr["text_proj.proj.weight"] == lr["logit_scale"] == lr["vision.norm.weight"] == 1e-5


def test_users_command_on_a_hugging_face_clip(tmp_path_factory, tmp_path, cli):
    """`vltrain train configs/finetune-clip.yaml model.init=HF_FOLDER data.train=...` (a tiny random
    CLIPModel): the pretrained weights are kept as init.safetensors, and --interpolate 0 exports them."""
    pytest.importorskip("transformers")
    from kits.pretrainedkit import make_clip

    from vltrain.export.native import export_model
    from vltrain.compose.decide import decide
    from vltrain.compose.opening import open_model

    shapes = session_shapes(tmp_path_factory)
    make_clip(tmp_path / "clip")
    run = tmp_path / "run"
    small = ["train.max_steps=2", "train.warmup_steps=1", "train.precision=fp32", "train.threads=1",
             "train.progress=false", "data.batch_size=4", "data.num_workers=0", "checkpoint.every=0",
             "train.freeze=[vision]", "train.unlock_last=1"]
    proc = cli("train", RECIPE, f"model.init={tmp_path / 'clip'}", f"data.train={shapes / 'train.jsonl'}",
               f"run.dir={run}", *small)
    assert proc.returncode == 0, proc.stderr[-3000:]

    pretrained = open_model(decide(load_config(run / "config.yaml"))).model.state_dict()  # the run's model.init
    initial = load_file(str(run / INITIAL_FILE))
    assert initial.keys() == pretrained.keys()
    assert all(torch.equal(initial[k], v) for k, v in pretrained.items())
    got = load_file(str(export_model(run, tmp_path / "a0", interpolate=0.0) / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in initial.items())


def _fake_trainer(run_dir: Path, save_initial: str, init: str, main: bool = True, seed: int = 0):
    from kits.modelkit import small_model

    cfg = load_config(None, [f"checkpoint.save_initial={save_initial}", f"model.init={init}"])
    return SimpleNamespace(cfg=cfg, world=SimpleNamespace(is_main=main), run_dir=run_dir, model=small_model(seed=seed),
                           decided=SimpleNamespace(weights=Path(init) if init else None))


@pytest.mark.parametrize("save_initial, init, main, written", [
    ("auto", "", True, False), ("auto", "/models/clip", True, True), ("auto", "/models/clip", False, False),
    ("always", "", True, True), ("never", "/models/clip", True, False),
])
def test_initial_weights_written_when_asked(tmp_path, save_initial, init, main, written):
    from vltrain.train.trainer import Trainer

    trainer = _fake_trainer(tmp_path, save_initial, init, main)
    Trainer._save_initial(trainer, trainer.model)
    assert (tmp_path / INITIAL_FILE).is_file() == written
    if written:  # a resumed run keeps its first start's weights
        later = _fake_trainer(tmp_path, save_initial, init, main, seed=1)
        Trainer._save_initial(later, later.model)
        saved = load_file(str(tmp_path / INITIAL_FILE))
        assert all(torch.equal(saved[k], v) for k, v in trainer.model.state_dict().items())
        assert not list(tmp_path.glob("*.part"))


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """3 steps of tiny-clip with layer decay, the vision tower frozen but its last block."""
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path_factory.mktemp("finetune") / "run"
    cfg = load_config(RECIPE, overrides(
        shapes, run, train__max_steps=3, data__num_workers=0, checkpoint__every=0, train__layer_decay=0.7,
        train__freeze="[vision]", train__unlock_last=1, checkpoint__save_initial="always",
        data__max_text_length=16, eval__every=0))
    train_here(cfg)
    return run


def test_finetune_run_trains_only_the_unlocked_part(finetuned):
    initial = load_file(str(finetuned / INITIAL_FILE))
    final = {k.removeprefix("model."): v for k, v in final_state(finetuned).items() if k.startswith("model.")}
    assert initial.keys() == final.keys()
    changed = {k for k in final if not torch.equal(initial[k], final[k])}
    assert not any(k.startswith(("vision.blocks.0.", "vision.blocks.1.", "vision.patch_embed", "vision.pos_embed"))
                   for k in changed)
    assert any(k.startswith("vision.blocks.2.") for k in changed)
    assert any(k.startswith("text.blocks.0.") for k in changed) and "text_proj.proj.weight" in changed


def test_export_interpolates_between_initial_and_final(finetuned, tmp_path, cli):
    from vltrain.export.native import export_model

    initial = load_file(str(finetuned / INITIAL_FILE))
    final = {k.removeprefix("model."): v for k, v in final_state(finetuned).items() if k.startswith("model.")}
    for alpha, want in ((0.0, initial), (1.0, final)):
        got = load_file(str(export_model(finetuned, tmp_path / f"a{alpha}", interpolate=alpha) / "model.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in want), alpha

    proc = cli("export", finetuned, "--out", tmp_path / "half", "--interpolate", "0.5")
    assert proc.returncode == 0, proc.stderr
    assert "0.5 x initial + 0.5 x fine-tuned" in proc.stdout
    half = load_file(str(tmp_path / "half" / "model.safetensors"))
    for k in final:
        torch.testing.assert_close(half[k], (initial[k] + final[k]) / 2, rtol=0, atol=1e-7)
        if torch.equal(initial[k], final[k]):  # frozen: exactly itself
            assert torch.equal(half[k], final[k]), k
    # a checkpoint folder finds the initial weights in its run folder
    ckpt = sorted((finetuned / "checkpoints").glob("step-*"))[-1]
    again = load_file(str(export_model(ckpt, tmp_path / "from-ckpt", interpolate=0.5) / "model.safetensors"))
    assert all(torch.equal(again[k], half[k]) for k in half)


def test_interpolate_refuses_without_initial_weights_or_outside_0_1(finetuned, tmp_path, cli):
    from vltrain.export.native import export_model

    with pytest.raises(UserError, match=r"--interpolate must be in \[0, 1\]"):
        export_model(finetuned, tmp_path / "x", interpolate=1.5)
    ckpt = sorted((finetuned / "checkpoints").glob("step-*"))[-1]
    elsewhere = tmp_path / "copy" / "checkpoints" / ckpt.name
    import shutil

    shutil.copytree(ckpt, elsewhere)
    proc = cli("export", elsewhere, "--out", tmp_path / "y", "--interpolate", "0.5")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "init.safetensors" in proc.stderr and "checkpoint.save_initial=always" in proc.stderr
    assert not (tmp_path / "y").exists()


@pytest.mark.timeout(180)
def test_fsdp_run_interpolates_from_its_consolidated_weights(tmp_path_factory, tmp_path):
    """Two FSDP2 ranks with layer decay and an unlocked block of the frozen vision tower: the initial
    weights are written whole before sharding, and export blends them with the consolidated shards."""
    from kits.runkit import ok, train

    from vltrain.export.native import export_model

    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "fsdp"
    ok(train(shapes, run, train__parallelism="fsdp", train__max_steps=3, checkpoint__every=0,
             train__layer_decay=0.7, train__freeze="[vision]", train__unlock_last=1,
             checkpoint__save_initial="always"))
    initial = load_file(str(run / INITIAL_FILE))
    final = {k.removeprefix("model."): v for k, v in final_state(run).items() if k.startswith("model.")}
    assert torch.equal(initial["vision.blocks.0.norm1.weight"], final["vision.blocks.0.norm1.weight"])
    assert not torch.equal(initial["vision.blocks.2.norm1.weight"], final["vision.blocks.2.norm1.weight"])
    for alpha, want in ((0.0, initial), (1.0, final)):
        got = load_file(str(export_model(run, tmp_path / f"a{alpha}", interpolate=alpha) / "model.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in want), alpha


@pytest.mark.timeout(180)
def test_layer_decayed_run_resumes_exactly(tmp_path_factory, tmp_path):
    """The scaled parameter groups (lr, lr_scale) go through the checkpoint: stopped after step 5
    and resumed from step 4, the run ends bit-identical to one never stopped."""
    from kits.runkit import assert_identical, assert_resumed_exactly, ok, train

    shapes = session_shapes(tmp_path_factory)
    knobs = dict(nproc=1, train__max_steps=6, train__layer_decay=0.7, train__freeze="[vision]", train__unlock_last=1)
    ok(train(shapes, tmp_path / "whole", **knobs))
    assert train(shapes, tmp_path / "stopped", fault="raise:at=step:step=5", **knobs).returncode != 0
    assert_resumed_exactly(ok(train(shapes, tmp_path / "stopped", **knobs)), tmp_path / "stopped", 4)
    assert_identical(final_state(tmp_path / "whole"), final_state(tmp_path / "stopped"))
