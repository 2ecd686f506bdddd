"""train.ema: the weight EMA's math, its place in the checkpoint, evaluation beside the trained
weights, ``export --ema`` and ``eval --ema``; on 2 ranks under FSDP2, an exact resume. Its
agreement across splits and world sizes: ``tests/train/test_global_batch.py`` (the itc case)."""

from __future__ import annotations

import json

import pytest
import torch
from kits.runkit import (
    assert_identical, assert_resumed_exactly, final_state, from_checkpoint, ok, overrides, session_shapes, train,
    train_here,
)
from safetensors.torch import load_file, save_file

from vltrain.checkpoint.paths import find_checkpoint
from vltrain.checkpoint.storage import read_tensors
from vltrain.config.job import EmaSettings, load_config
from vltrain.errors import ConfigError, UserError
from vltrain.train.ema import WeightAverage


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # frozen: not averaged
    return model


def test_each_due_update_moves_the_average_by_one_minus_the_decay():
    model = tiny()
    ema = WeightAverage(EmaSettings(decay=0.9, every=2), model)
    assert ema.names == ["0.weight", "0.bias", "1.weight"]
    start = [w.clone() for w in ema.weights]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.after_step(1)  # not due: every 2 steps
    assert all(torch.equal(w, s) for w, s in zip(ema.weights, start)) and ema.updates == 0
    ema.after_step(2)
    trained = [p for p in model.parameters() if p.requires_grad]
    for w, s, p in zip(ema.weights, start, trained):
        torch.testing.assert_close(w, 0.9 * s + 0.1 * p, rtol=0, atol=1e-6)
    assert ema.updates == 1 and all(w.dtype == torch.float32 for w in ema.weights)


def test_the_warmup_starts_with_a_short_memory_and_never_passes_the_decay():
    ema = WeightAverage(EmaSettings(decay=0.999, warmup=True), tiny())
    decays = [ema.decay(t) for t in (1, 10, 100, 10**4, 10**6)]
    assert decays[0] == pytest.approx(1 - 2 ** (-2 / 3)) and decays == sorted(decays)
    assert decays[2] == pytest.approx(1 - 101 ** (-2 / 3)) and decays[-1] == 0.999
    assert WeightAverage(EmaSettings(decay=0.99), tiny()).decay(1) == 0.99


def test_the_average_is_applied_inside_the_block_and_the_trained_weights_return_bit_for_bit():
    model = tiny()
    ema = WeightAverage(EmaSettings(decay=0.5), model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0).add_(0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema.after_step(1)
    with ema.applied():
        trained = dict(zip(ema.names, ema.weights))
        for name, p in model.named_parameters():
            assert torch.equal(p, trained[name] if name in trained else before[name])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_state_round_trips_and_another_set_of_parameters_is_refused():
    a, b = WeightAverage(EmaSettings(decay=0.9), tiny()), WeightAverage(EmaSettings(decay=0.9), tiny())
    a.after_step(1)
    with torch.no_grad():
        a.weights[0].add_(1.0)
    b.load_state_dict(a.state_dict())
    assert b.updates == 1 and all(torch.equal(x, y) for x, y in zip(a.weights, b.weights))
    other = tiny()
    other[0].bias.requires_grad_(False)
    with pytest.raises(UserError, match="EMA averages other parameters .* train.freeze"):
        WeightAverage(EmaSettings(decay=0.9), other).load_state_dict(a.state_dict())


def test_out_of_range_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"train.ema.decay must be in \[0, 1\)"):
        load_config(None, ["train.ema.decay=1.0"])
    with pytest.raises(ConfigError, match="train.ema.every must be >= 1"):
        load_config(None, ["train.ema.decay=0.9", "train.ema.every=0"])


@pytest.mark.timeout(300)
def test_a_run_evaluates_saves_exports_and_evaluates_its_average(tmp_path_factory, tmp_path, cli):
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    cfg = load_config(None, overrides(shapes, run, data__val=shapes / "val.jsonl", data__num_workers=0, eval__every=5,
                                      train__ema__decay=0.8, train__ema__warmup=True,
                                      checkpoint__save_initial="always"))
    trainer = train_here(cfg)
    last = json.loads((run / "eval.json").read_text())[-1]
    assert {"t2i_r1", "ema/t2i_r1", "ema/mean_recall"} <= set(last) and "ema/num_pairs" not in last
    saved = read_tensors(find_checkpoint(run))
    averaged = {k.removeprefix("ema.weights."): v for k, v in saved.items() if k.startswith("ema.weights.")}
    assert sorted(averaged) == sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(v.dtype == torch.float32 for v in averaged.values())
    assert any(not torch.equal(v, saved[f"model.{k}"]) for k, v in averaged.items())

    proc = cli("export", run, "--out", tmp_path / "ema", "--ema")
    assert proc.returncode == 0 and "(the EMA weights)" in proc.stdout, proc.stderr
    exported = load_file(tmp_path / "ema" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in averaged.items())
    assert cli("export", run, "--out", tmp_path / "blend", "--ema", "--interpolate", "0.5").returncode == 0
    initial, blend = load_file(run / "init.safetensors"), load_file(tmp_path / "blend" / "model.safetensors")
    for k, v in averaged.items():
        torch.testing.assert_close(blend[k], 0.5 * initial[k] + 0.5 * v, rtol=0, atol=1e-6)

    proc = cli("eval", run, "--ema", "--json", "train.threads=1")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["t2i_r1"] == last["ema/t2i_r1"]
    refused = cli("eval", tmp_path / "ema", "--ema")
    assert refused.returncode != 0 and "is an export, which holds one set of weights: drop --ema" in refused.stderr


@pytest.mark.timeout(300)
def test_a_checkpoint_without_an_average_is_refused_with_what_to_do(tmp_path_factory, tmp_path, cli):
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    train_here(load_config(None, overrides(shapes, run, data__num_workers=0, train__max_steps=4)))
    with pytest.raises(UserError, match="holds no EMA weights: its run trained without train.ema. Resume it with "
                                        "train.ema.decay=0, or start a new run .* model.init="):
        train_here(load_config(None, overrides(shapes, run, data__num_workers=0, train__max_steps=6,
                                               train__ema__decay=0.9)))
    proc = cli("export", run, "--out", tmp_path / "out", "--ema")
    assert proc.returncode != 0 and "holds no EMA weights" in proc.stderr and "Traceback" not in proc.stderr


def run_files(run) -> dict[str, bytes]:
    """Every file of a run folder, by its path in the folder."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.timeout(300)
def test_a_resume_that_would_drop_the_average_is_refused_and_changes_nothing(tmp_path_factory, tmp_path, cli):
    """Without train.ema the next checkpoints would lack the average and checkpoint.keep would delete
    the ones that hold it: refused in one line naming the setting; train.resume_drop=[ema] goes on."""
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    settings = {"data__num_workers": 0, "checkpoint__every": 2, "checkpoint__keep": 1}
    train_here(load_config(None, overrides(shapes, run, train__max_steps=4, train__ema__decay=0.9, **settings)))
    before = run_files(run)
    args = overrides(shapes, run, train__max_steps=6, **settings)
    proc = cli("train", shapes / "base.yaml", *args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "holds state this run would leave behind: its EMA weights" in proc.stderr
    assert "train.resume_drop=[ema]" in proc.stderr
    assert run_files(run) == before
    ok(cli("train", shapes / "base.yaml", *args, "train.resume_drop=[ema]"))
    assert not any(k.startswith("ema.") for k in final_state(run))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change", ["train.ema.decay=0.9", "model.preset=tiny-albef",
                                    "model.loss.distill=1 model.teacher.path={teacher}"])
def test_a_refused_resume_leaves_every_file_of_the_run_as_it_was(change, tmp_path_factory, tmp_path, cli):
    """The issue's three: each was refused after config.yaml had been written over."""
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    settings = {"data__num_workers": 0, "checkpoint__every": 2}
    train_here(load_config(None, overrides(shapes, run, train__max_steps=2, **settings)))
    (partial := run / "checkpoints" / ".tmp-step-3").mkdir()  # a crash cut this save short
    (partial / "__0_0.distcp").write_bytes(b"half")
    before = run_files(run)
    teacher = tmp_path / "teacher"  # an export found and read, whose weights fail when it is opened
    teacher.mkdir()
    (teacher / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    (teacher / "tokenizer.json").write_bytes((shapes / "tokenizer.json").read_bytes())
    save_file({"other": torch.zeros(1)}, str(teacher / "model.safetensors"))
    args = overrides(shapes, run, train__max_steps=4, **settings)
    proc = cli("train", shapes / "base.yaml", *args, *change.format(teacher=teacher).split())
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "error:" in proc.stderr, proc.stderr
    assert run_files(run) == before
    ok(cli("train", run / "config.yaml", "train.max_steps=4"))  # the documented resume still works
    assert not partial.exists()


@pytest.mark.timeout(600)
def test_two_ranks_under_fsdp2_stopped_and_resumed_keep_the_average_bit_identical(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    knobs = {"train__parallelism": "fsdp", "train__ema__decay": 0.9, "train__ema__warmup": "true",
             "train__ema__every": 2}
    ref = tmp_path / "ref"
    ok(train(shapes, ref, **knobs))
    run = from_checkpoint(ref, tmp_path / "run")
    assert_resumed_exactly(ok(train(shapes, run, **knobs)), run, 4)
    ended = final_state(run)
    assert any(k.startswith("ema.weights.") for k in ended)
    assert_identical(final_state(ref), ended)
