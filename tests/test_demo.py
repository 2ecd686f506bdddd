"""The demo config learns: a short run on a small synthetic set ends with a lower loss."""

from __future__ import annotations

import json

import pytest

from vltrain.train.metrics import read_jsonl


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_trains_to_a_falling_loss(cli, tmp_path):
    run = tmp_path / "run"
    proc = cli("demo", "--dir", run, "--data", tmp_path / "shapes", "--num", 1000, "--val", 100,
               "train.max_steps=40", "train.warmup_steps=5", "train.log_every=5", "eval.every=0",
               "data.batch_size=32", "eval.batch_size=100", "train.threads=2", timeout=580)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 8
    first = (rows[0]["loss"] + rows[1]["loss"]) / 2
    last = (rows[-2]["loss"] + rows[-1]["loss"]) / 2
    assert last < first - 0.1, [r["loss"] for r in rows]
    evals = json.loads((run / "eval.json").read_text())
    assert evals[-1]["step"] == 40 and evals[-1]["num_pairs"] == 100
    assert (run / "curves.png").exists() and (run / "config.yaml").exists()
    assert "text->image R@1" in proc.stdout and "curves.png" in proc.stdout
    assert "zero-shot shape kind (180 images, 6 classes)" in proc.stdout and "(chance: 0.167)" in proc.stdout
    assert evals[-1]["zeroshot/shapes/num_images"] == 180


def test_step_count_fits_the_time_budget_within_bounds():
    from vltrain.demo import MAX_STEPS, MIN_STEPS, STEP_QUANTUM, TRAIN_SECONDS, choose_steps

    assert choose_steps(1e9, 128) == MAX_STEPS  # a fast CPU trains the whole schedule
    assert choose_steps(1.0, 128) == MIN_STEPS  # a slow one still trains enough to learn
    rate = 128 * 750 / TRAIN_SECONDS  # 750 steps fit: rounded down to the quantum
    assert choose_steps(rate, 128) == 700 and 700 % STEP_QUANTUM == 0
    assert choose_steps(rate * 1.01, 128) == choose_steps(rate * 1.05, 128)  # small jitter, same count


def test_measured_rate_is_the_demo_models_training_speed():
    from vltrain.config.job import load_config
    from vltrain.demo import demo_config_path, measure_rate

    cfg = load_config(demo_config_path(), ["data.batch_size=8", "train.threads=1"])
    rate = measure_rate(cfg, steps=2)
    assert 1 < rate < 1e6
