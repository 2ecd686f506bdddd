"""Real training runs for the resume, fault-tolerance and export tests.

Runs are tiny (32 x 32 shapes, 64 rows, 4 rows per rank: an epoch is 8 steps on 2 ranks) so a
2-rank torchrun launch is a few seconds, most of it start-up. The uninterrupted reference run of
each preset is made once per session and shared by every test that compares against it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kits import forkrun
from kits.multiproc import free_port

from vltrain.checkpoint.manager import find_checkpoint
from vltrain.checkpoint.storage import read_tensors
from vltrain.runtime.faults import Fault

STEPS = 10
EVERY = 4
"""Checkpoints at steps 4 and 8 and at the end; a stop at step 6 resumes mid-epoch from step 4."""
IN_STEP_FAULTS = ("overflow",)
"""Fault actions that stop no rank (an inf in one rank's gradients): their runs fork as any other."""


def make_shapes(root: Path) -> Path:
    """Synthetic shapes and a tokenizer trained on them (once per session)."""
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    if not (root / "tokenizer.json").exists():
        synthesize(root, 64, 16, text_only_fraction=0.2, seed=0, image_size=32)
        train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=200)
        (root / "base.yaml").write_text("# everything is given as overrides\n{}\n")
    return root


def overrides(shapes: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": run_dir,
        "data.train": shapes / "train.jsonl",
        "data.val": "''",
        "data.tokenizer": shapes / "tokenizer.json",
        "data.image_size": 32,
        "data.mean": "[0.5,0.5,0.5]",
        "data.std": "[0.5,0.5,0.5]",
        "data.max_text_length": 16,
        "data.batch_size": 4,
        "data.num_workers": 2,
        "data.shuffle": True,
        "model.preset": "tiny-clip",
        "train.max_steps": STEPS,
        "train.warmup_steps": 2,
        "train.lr": 1e-3,
        "train.precision": "fp32",
        "train.threads": 1,
        "train.log_every": 5,
        "train.progress": False,
        "train.timeout_s": 60,
        "checkpoint.every": EVERY,
        "checkpoint.keep": 0,
        "metrics.curves": False,  # a second of matplotlib per run, over a hundred runs
    }
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def train(shapes: Path, run_dir: Path, *, nproc: int = 2, max_restarts: int = 0, fault: str = "",
          torchrun: bool = False, timeout: float = 120, **extra) -> subprocess.CompletedProcess:
    """``vltrain train`` on ``nproc`` ranks (gloo on 127.0.0.1); ``fault`` sets VLTRAIN_FAULT.

    With no restarts, and no fault on more than one rank, the ranks are forked from processes that
    have already imported vltrain (:mod:`kits.forkrun`: one process as ``python -m vltrain train``,
    several joined through the environment as Slurm's ``srun`` starts them): the same run, without
    the five CPU-seconds of imports per process or torchrun's agent. Restarts and faults on several
    ranks that stop one need the agent, and run under torchrun, as does a test of torchrun's own part
    (``torchrun``)."""
    if not (torchrun or max_restarts) and (nproc == 1 or not fault or Fault.parse(fault).action in IN_STEP_FAULTS):
        return finish(launch(["train", str(shapes / "base.yaml"), *overrides(shapes, run_dir, **extra)], nproc,
                             fault=fault), timeout)
    agent = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
             "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return finish(start(train_command(shapes, run_dir, agent, **extra), fault), timeout)


def launch(argv: list, nproc: int = 1, *, cwd: Path | None = None, fault: str = ""):
    """Start ``vltrain ARGV`` on ``nproc`` ranks, forked (:mod:`kits.forkrun`); :func:`finish` waits."""
    argv = [str(a) for a in argv]
    if nproc == 1:
        return forkrun.Forked(argv, cwd=cwd, env=launch_env(fault))
    return forkrun.World(argv, nproc, free_port(), cwd=cwd, env=launch_env(fault))


def train_here(cfg):
    """Run ``cfg`` to its end in this process (one rank, no torchrun) and close it; returns the trainer."""
    from vltrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def train_command(shapes: Path, run_dir: Path, launch: list[str], **extra) -> list[str]:
    """``torchrun LAUNCH... -m vltrain train`` with the tiny run's overrides."""
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            "-m", "vltrain", "train", str(shapes / "base.yaml"), *overrides(shapes, run_dir, **extra)]


def launch_env(fault: str = "") -> dict[str, str]:
    """This process's environment, one thread per process, and VLTRAIN_FAULT as ``fault`` says."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VLTRAIN_FAULT", None)
    if fault:
        env["VLTRAIN_FAULT"] = fault
    return env


def start(cmd: list[str], fault: str = "") -> subprocess.Popen:
    """Start a launcher in its own session, so that a timeout kills it, its workers and their loader workers."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(fault),
                            start_new_session=True)


def finish(proc, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started launcher (a Popen, or :mod:`kits.forkrun`'s); past ``timeout`` kill its
    whole session and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if isinstance(proc, subprocess.Popen):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-3000:]}\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def session_shapes(tmp_path_factory) -> Path:
    return make_shapes(tmp_path_factory.getbasetemp() / "shapes")


def reference(tmp_path_factory, preset: str) -> Path:
    """The uninterrupted 2-rank run of ``preset``, made once per session."""
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path_factory.getbasetemp() / f"reference-{preset}"
    if not (run / "checkpoints" / "latest").exists():
        ok(train(shapes, run, model__preset=preset))
    return run


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint: the model and the optimizer's moments."""
    return read_tensors(find_checkpoint(run_dir))


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


def from_checkpoint(source_run: Path, run: Path, step: int = EVERY) -> Path:
    """A run folder holding ``source_run``'s checkpoint of ``step`` as its latest, so that the next
    ``train`` into it resumes there: a resume test at the cost of one launch, where the kill of a
    run is not what is tested (``tests/train/test_resume.py`` and ``test_fault_tolerance.py`` kill
    real runs). The checkpoint is the one a run stopped after ``step`` would have left, as training
    is deterministic up to the stop."""
    shutil.copytree(source_run / "checkpoints" / f"step-{step}", run / "checkpoints" / f"step-{step}")
    (run / "checkpoints" / "latest").write_text(f"step-{step}")
    return run


def assert_resumed_exactly(proc: subprocess.CompletedProcess, run: Path, step: int) -> None:
    assert f"resumed from {run / 'checkpoints' / f'step-{step}'} at step {step} (exactly)" in proc.stderr, proc.stderr


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.startswith("{")]
    return [r for r in rows if "loss" in r]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metric_rows(run_dir)]


FIGURES = "VLTRAIN_TEST_FIGURES"
"""A file to which :func:`worst` and :func:`model_distance` append each figure they measure, with the
test that asked (a JSON line each), when set: what a CPU kind's cross-split comparisons read."""


def _record(what: str, value: float) -> float:
    if os.environ.get(FIGURES):
        row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "what": what, "value": value}
        with open(os.environ[FIGURES], "a") as f:
            f.write(json.dumps(row) + "\n")
    return value


def worst(curve: list[float], base: list[float]) -> float:
    """The largest relative difference of two loss curves (a step of text-only rows has loss 0)."""
    return _record("loss curve", max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, base)))


def model_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "model.") -> float:
    """||a - b|| / ||b|| over every model parameter (``prefix`` "ema.weights.": over the EMA's)."""
    keys = [k for k in b if k.startswith(prefix)]
    assert keys, f"no {prefix} tensors"
    x = torch.cat([a[k].flatten().double() for k in keys])
    y = torch.cat([b[k].flatten().double() for k in keys])
    return _record(f"weights ({prefix}*)", float((x - y).norm() / y.norm()))


def assert_same_training(runs: dict[str, Path], ref: Path, steps: int, tol: float) -> None:
    """Every run of ``runs`` logged ``ref``'s curve (``steps`` losses) and ended at its model, within ``tol``."""
    base = losses(ref)
    assert len(base) == steps
    for name, run_dir in runs.items():
        curve = losses(run_dir)
        assert worst(curve, base) < tol, (name, curve, base)
        assert model_distance(final_state(run_dir), final_state(ref)) < tol, name


def assert_recalls(metrics: dict, prefix: str, images: int, captions: int, rerank_k: int = 0) -> None:
    """One retrieval set's recalls (``{prefix}i2t_r1`` ...) as the protocol of eval/retrieval.py makes
    them: each a whole number of queries (images for image->text, captions for text->image), growing
    with k; and, re-ranked by ITM (``itm_``), equal to the embedding recall at every k at or past the
    re-ranking depth, since re-ranking only reorders each query's top ``rerank_k``."""
    queries = {"i2t": images, "t2i": captions}
    for kind in ("", "itm_") if rerank_k else ("",):
        for d, n in queries.items():
            r = [metrics[f"{prefix}{kind}{d}_r{k}"] for k in (1, 5, 10)]
            assert r == sorted(r), f"{prefix}{kind}{d} recalls fall with k: {r}"
            # eval.json keeps 6 decimals
            assert all(abs(x * n - round(x * n)) <= n * 1e-6 for x in r), f"{prefix}{kind}{d}: {r} are not counts of {n}"
    if rerank_k:
        for d in queries:
            past = [k for k in (1, 5, 10) if k >= rerank_k]
            assert past, f"re-ranking depth {rerank_k} is past every recall"
            for k in past:
                assert metrics[f"{prefix}itm_{d}_r{k}"] == metrics[f"{prefix}{d}_r{k}"], (d, k, metrics)
            # the re-ranked first candidate is one of the embedding's top rerank_k
            assert metrics[f"{prefix}itm_{d}_r1"] <= metrics[f"{prefix}{d}_r{past[0]}"], (d, metrics)


def assert_same_recall(got: dict, want: dict) -> None:
    """Every recall of ``want`` in ``got``, to one query of ``num_pairs`` (embeddings equal to float
    rounding can swap a near tie)."""
    keys = [k for k in want if "_r" in k and k.split("_r")[-1].isdigit()]
    assert keys and want["num_pairs"] == got["num_pairs"] > 0
    for k in keys:
        assert got[k] == pytest.approx(want[k], abs=1 / want["num_pairs"] + 1e-9), (k, got, want)
