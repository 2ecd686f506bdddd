"""The trainer end to end: one process vs two ranks, DDP and FSDP2, guards, gradient caching.

Every run here is tiny (32 x 32 shapes, the tiny-clip preset, a few hundred rows) so that
real multi-process runs take seconds on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kits.runkit import finish, launch, ok

from vltrain.train.metrics import read_jsonl

STEPS = 20


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    root = tmp_path_factory.mktemp("shapes")
    synthesize(root, 256, 64, text_only_fraction=0.2, seed=0, image_size=32)
    train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=256)
    return root


def overrides(shapes: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": run_dir,
        "data.train": shapes / "train.jsonl",
        "data.val": shapes / "val.jsonl",
        "data.tokenizer": shapes / "tokenizer.json",
        "data.image_size": 32,
        "data.max_text_length": 24,
        "data.num_workers": 0,
        "data.batch_size": 8,
        "model.preset": "tiny-clip",
        "train.max_steps": STEPS,
        "train.warmup_steps": 5,
        "train.lr": 1e-3,
        "train.log_every": 1,
        "train.threads": 1,
        "train.precision": "fp32",
        "train.progress": False,
        "eval.batch_size": 32,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train(shapes: Path, run_dir: Path, nproc: int = 1, timeout: float = 240, **extra) -> list[dict]:
    repo = Path(__file__).resolve().parents[2]
    ok(finish(launch(["train", "configs/demo.yaml", *overrides(shapes, run_dir, **extra)], nproc, cwd=repo), timeout))
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


_ONE_PROCESS: dict[str, tuple[Path, list[dict]]] = {}


def one_process(shapes: Path, tmp_path_factory, name: str, **extra) -> tuple[Path, list[dict]]:
    """A one-process reference run, made once for the tests of this module that compare with it."""
    if name not in _ONE_PROCESS:
        run_dir = tmp_path_factory.mktemp(name)
        _ONE_PROCESS[name] = run_dir, train(shapes, run_dir, **extra)
    return _ONE_PROCESS[name]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_with_the_global_batch(shapes, tmp_path, tmp_path_factory, parallelism):
    _, one = one_process(shapes, tmp_path_factory, "one", **{"data.batch_size": 16, "eval.every": 0})
    two = train(shapes, tmp_path / "two", nproc=2, **{"data.batch_size": 8, "train.parallelism": parallelism})
    assert len(one) == len(two) == STEPS
    assert [r["samples_seen"] for r in one] == [r["samples_seen"] for r in two]
    assert losses(one) == pytest.approx(losses(two), abs=1e-5, rel=1e-5)
    assert losses(one)[-1] < losses(one)[0]
    # the logged rate is the one each step trained at: warmup over 5 steps, then the peak
    assert [r["lr"] for r in one[:6]] == pytest.approx([1e-3 * k / 6 for k in range(1, 6)] + [1e-3])
    # evaluation ran on both ranks and rank 0 wrote it
    evals = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert evals[-1]["step"] == STEPS and evals[-1]["num_pairs"] == 64


@pytest.mark.timeout(300)
def test_nan_on_one_rank_skips_the_step_on_both(shapes, tmp_path):
    rows = train(shapes, tmp_path / "nan", nproc=2, **{
        "train.max_steps": 8, "train.debug_nan_step": 3, "train.debug_nan_rank": 1, "eval.every": 0,
    })
    by_step = {r["step"]: r for r in rows}
    assert by_step[4]["skipped"] is True and by_step[4]["skipped_total"] == 1
    assert all(not by_step[s]["skipped"] for s in (1, 2, 3, 5, 6, 7, 8))
    assert len(rows) == 8  # training went on to the end
    import torch

    from vltrain.checkpoint.manager import find_checkpoint
    from vltrain.checkpoint.storage import read_tensors

    weights = read_tensors(find_checkpoint(tmp_path / "nan"), "model.")
    assert all(torch.isfinite(v).all() for v in weights.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nonfinite_steps_in_a_row_stop_with_a_clear_error(shapes, tmp_path):
    from vltrain.config.job import load_config
    from vltrain.errors import NonFiniteError
    from vltrain.train.trainer import Trainer

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml", overrides(
        shapes, tmp_path / "div", **{"train.lr": 1e9, "train.warmup_steps": 0, "train.grad_clip": 0,
                                    "train.max_nonfinite_steps": 2, "data.val": ""}))
    trainer = Trainer(cfg)
    try:
        # a loss that is NaN on every step from step 2 on: two in a row stop the run, at the
        # first log step that reads the device's count (settle; log_every 1 here: every step)
        object.__setattr__(trainer.cfg.train, "debug_nan_step", 2)  # past the frozen config
        trainer.train_step([next(trainer.loader)])
        trainer.settle()
        trainer.step = 2
        trainer.train_step([next(trainer.loader)])
        trainer.settle()
        object.__setattr__(trainer.cfg.train, "debug_nan_step", 3)  # past the frozen config
        trainer.step = 3
        trainer.train_step([next(trainer.loader)])
        with pytest.raises(NonFiniteError, match="2 steps in a row"):
            trainer.settle()
    finally:
        trainer.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,parallelism", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_gradcache_accumulation_matches_the_big_batch(shapes, tmp_path, tmp_path_factory, nproc, parallelism):
    """Cached micro-batches (two per rank) train like one batch of 16 in one process: same loss
    curve (fp32), because the contrastive loss of every step sees all 16 rows."""
    common = {"train.max_steps": 6, "eval.every": 0, "data.val": ""}
    _, big = one_process(shapes, tmp_path_factory, "big", **{"data.batch_size": 16, **common})
    cached = train(shapes, tmp_path / "gc", nproc=nproc, **{
        "data.batch_size": 8 // nproc, "train.accumulation": 2, "train.contrastive_accumulation": "gradcache",
        "train.parallelism": parallelism, **common,
    })
    assert losses(big) == pytest.approx(losses(cached), abs=1e-5, rel=1e-5)


@pytest.mark.timeout(300)
def test_eval_command_reproduces_the_final_evaluation(shapes, tmp_path, cli):
    run = tmp_path / "ev"
    train(shapes, run, **{"train.max_steps": 3, "eval.every": 0})
    proc = cli("eval", run, "train.threads=1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    final = json.loads((run / "eval.json").read_text())[-1]
    assert printed["t2i_r1"] == final["t2i_r1"] and printed["num_pairs"] == final["num_pairs"] == 64
    assert cli("eval", tmp_path / "missing").returncode != 0


@pytest.mark.timeout(300)
def test_the_regions_a_loader_drops_are_counted_over_every_rank(shapes, tmp_path):
    """One epoch of 16 rows on 2 ranks: every row once. Shapes rows keep their first region
    (data.max_regions 1) and the rest are capped; each wide image's center crop cuts its two side
    regions away. The logged counts are the world's."""
    from PIL import Image

    from vltrain.data.tools.synth import synthesize

    rows = [json.loads(line) for line in synthesize(tmp_path / "r", 8, 0, image_size=32, workers=1,
                                                     with_regions=True)["train"].read_text().splitlines()]
    Image.new("RGB", (64, 32), (90, 90, 90)).save(tmp_path / "r" / "wide.png")
    sides = [{"box": [0, 0, 10, 10], "text": "the left"}, {"box": [20, 5, 40, 25], "text": "the middle"},
             {"box": [55, 0, 64, 32], "text": "the right"}]
    rows += [{"id": f"wide{i}", "image": "wide.png", "text": "a grey picture", "regions": sides} for i in range(8)]
    (tmp_path / "r" / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logged = train(shapes, tmp_path / "run", nproc=2, **{
        "data.train": tmp_path / "r" / "m.jsonl", "data.val": "''", "data.global_batch_size": 8,
        "data.max_regions": 1, "train.max_steps": 2, "train.warmup_steps": 1, "eval.every": 0})
    capped = sum(len(r["regions"]) - 1 for r in rows[:8])
    assert capped > 0 and [(r["data/regions_cut"], r["data/regions_capped"]) for r in logged][-1] == (16, capped)


@pytest.mark.parametrize("module,name", [("trainer", "Trainer"), ("step", "Step")])
def test_attributes_are_set_in_init_and_only_updated_elsewhere(module, name):
    """A reader finds every attribute of the Trainer (and of its Step) in ``__init__``: a helper may
    return values for ``__init__`` to assign, or update an attribute, but never create one."""
    import ast

    source = Path(__file__).resolve().parents[2] / "src" / "vltrain" / "train" / f"{module}.py"
    cls = next(n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)

    def assigned(fn: ast.FunctionDef) -> set[str]:
        names = set()
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
        return names

    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    init = assigned(next(m for m in methods if m.name == "__init__"))
    created = {m.name: sorted(assigned(m) - init) for m in methods if m.name != "__init__"}
    assert {k: v for k, v in created.items() if v} == {}
