"""LoRA (``train.lora``) through the real trainer: with patch dropout and the weight EMA on, one global
batch split four ways (1 rank, 1 rank x 2 micro-batches, 2 ranks under DDP and under FSDP2) trains the
same adapters; a run stopped on 2 ranks and resumed ends bit-identical; only the adapters train and
only they are checkpointed, the base written once; a bf16 run distilled from a teacher, started from a
Hugging Face CLIP, trains its adapters alone; and a run without LoRA never imports peft. Real
processes (gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kits.runkit import (assert_identical, assert_resumed_exactly, assert_same_training, final_state, from_checkpoint,
                         losses, ok, session_shapes, train)
from safetensors.torch import load_file

from vltrain.checkpoint.paths import LORA_BASE_FILE
from vltrain.compose.opening import open_model

pytest.importorskip("peft")

STEPS = 10
TOL = 1e-5
G = 12
LORA = {"train__lora__rank": 2, "train__lora__alpha": 4, "train__lora__targets": "[q_proj,v_proj,out_proj,fc1,fc2]",
        "model__vision__patch_dropout": 0.25, "train__ema__decay": 0.9, "data__global_batch_size": G,
        "train__max_steps": STEPS, "train__log_every": 1}
SPLITS = {"1 rank": (1, {}), "1 rank, A=2": (1, {"data__micro_batch_size": G // 2}),
          "2 ranks, DDP": (2, {}), "2 ranks, FSDP2": (2, {"train__parallelism": "fsdp"})}
_RUNS: dict[str, Path] = {}


def split_run(tmp_path_factory, name: str) -> Path:
    if name not in _RUNS:
        nproc, extra = SPLITS[name]
        if name != "2 ranks, FSDP2":  # the one resumed from (step 4): the others save their last step alone
            extra = {**extra, "checkpoint__every": 0}
        run_dir = tmp_path_factory.mktemp("lora") / name.replace(" ", "_").replace(",", "")
        ok(train(session_shapes(tmp_path_factory), run_dir, nproc=nproc, timeout=300, **LORA, **extra))
        _RUNS[name] = run_dir
    return _RUNS[name]


def _adapters(state: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in state if ".lora_" in k}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_global_batch_split_four_ways_trains_the_same_adapters(tmp_path_factory):
    runs = {name: split_run(tmp_path_factory, name) for name in SPLITS}
    ref = runs["1 rank"]
    assert_same_training(runs, ref, STEPS, TOL)

    state = final_state(ref)
    model = {k for k in state if k.startswith("model.")}
    # the checkpoint holds the adapters, their EMA and their optimizer moments, and nothing of the base
    blocks = {k.split(".attn.")[0] for k in load_file(str(ref / "checkpoints" / LORA_BASE_FILE)) if ".attn.qkv.weight" in k}
    assert model == _adapters(model) and len(model) == len(blocks) * 5 * 2  # A and B of 5 layers in every block
    assert {k.removeprefix("ema.weights.") for k in state if k.startswith("ema.")} == {k.removeprefix("model.") for k in model}
    assert not any(k.startswith("optimizer.") and ".lora_" not in k for k in state if "state." in k)
    base_file = ref / "checkpoints" / LORA_BASE_FILE
    assert base_file.is_file() and not _adapters(load_file(str(base_file)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stopped_on_two_ranks_and_resumed_it_ends_bit_identical(tmp_path_factory, tmp_path):
    unstopped = split_run(tmp_path_factory, "2 ranks, FSDP2")
    run_dir = from_checkpoint(unstopped, tmp_path / "run", 4)
    proc = ok(train(session_shapes(tmp_path_factory), run_dir, nproc=2, timeout=300, train__parallelism="fsdp", **LORA))
    assert_resumed_exactly(proc, run_dir, 4)
    assert_identical(final_state(run_dir), final_state(unstopped))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_run_opens_merged_and_its_frozen_weights_never_moved(tmp_path_factory):
    """Opened by path (eval, export), a LoRA run is its base plus the adapters folded in: the weights
    LoRA leaves alone equal the base's, the adapted ones moved, and the output is the unmerged model's."""
    run_dir = split_run(tmp_path_factory, "2 ranks, DDP")
    base = load_file(str(run_dir / "checkpoints" / LORA_BASE_FILE))
    merged = open_model(run_dir).model.state_dict()
    assert merged.keys() == base.keys()
    moved = {k for k in base if not torch.equal(base[k], merged[k])}
    adapted = (".attn.qkv.weight", ".attn.out.weight", ".mlp.fc.weight", ".mlp.proj.weight")
    assert moved == {k for k in base if ".blocks." in k and k.endswith(adapted)}, sorted(moved)
    unmerged = open_model(run_dir, merge=False).model
    assert any(".lora_" in n for n, _ in unmerged.named_parameters())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bf16_run_distilled_from_a_teacher_trains_the_adapters_of_a_hugging_face_clip(tmp_path_factory, tmp_path):
    from kits.pretrainedkit import make_clip

    shapes = session_shapes(tmp_path_factory)
    make_clip(tmp_path / "clip")
    make_clip(tmp_path / "teacher", seed=1)
    run_dir = tmp_path / "run"
    proc = ok(train(shapes, run_dir, nproc=1, timeout=300, model__init=tmp_path / "clip", model__preset="''",
                    data__tokenizer=tmp_path / "clip" / "tokenizer.json", train__precision="bf16",
                    model__loss__distill=1, model__teacher__path=tmp_path / "teacher", train__lora__rank=4,
                    train__lora__towers="[vision]", train__lora__last_blocks=1, train__max_steps=4,
                    checkpoint__every=4))
    assert "LoRA: rank 4 adapters on 4 layers (q_proj, k_proj, v_proj, out_proj of vision)" in proc.stderr
    rows = losses(run_dir)
    assert len(rows) > 0 and all(r == r for r in rows)
    state = final_state(run_dir)
    adapters = sorted(k for k in state if k.startswith("model."))
    assert adapters and all(k.startswith("model.vision.blocks.1.") and ".lora_" in k for k in adapters)
    assert any("lora_B" in k and state[k].abs().sum() > 0 for k in adapters)  # B starts at zero and trained


def test_a_run_without_lora_never_imports_peft(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    script = (
        "import sys\n"
        "from kits.runkit import overrides, train_here\n"
        "from vltrain.config.job import load_config\n"
        f"cfg = load_config({str(shapes / 'base.yaml')!r}, overrides(__import__('pathlib').Path({str(shapes)!r}), "
        f"__import__('pathlib').Path({str(tmp_path / 'run')!r}), train__max_steps=2, data__num_workers=0, "
        "checkpoint__every=0))\n"
        "train_here(cfg)\n"
        "print('peft imported' if 'peft' in sys.modules else 'no peft')\n"
    )
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tests, env={**__import__("os").environ, "PYTHONPATH": str(tests)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "no peft"
    assert not (tmp_path / "run" / "checkpoints" / LORA_BASE_FILE).exists()
