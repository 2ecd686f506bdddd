"""The demo config learns: a short run on a small synthetic set ends with a lower loss."""

from __future__ import annotations

import json

import pytest

from vltrain.train.metrics import read_jsonl


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
    # the demo model captions: the held-out images' metrics, and a few captions beside the truth
    assert evals[-1]["captions/shapes/num_images"] > 50 and evals[-1]["captions/shapes/cider"] > 0
    assert "captions of " in proc.stdout and "held-out images (greedy): BLEU-4 = " in proc.stdout
    assert proc.stdout.count("  truth:     ") == 4 and proc.stdout.count("  generated: ") == 4
    generated = [line.split("generated: ", 1)[1] for line in proc.stdout.splitlines() if "  generated: " in line]
    assert all(caption.split() for caption in generated), generated


def test_step_count_fits_the_time_budget_within_bounds():
    from vltrain.demo import MAX_STEPS, MIN_STEPS, STEP_QUANTUM, TRAIN_SECONDS, choose_steps

    assert choose_steps(1e9, 128) == MAX_STEPS  # a fast CPU trains the whole schedule
    assert choose_steps(1.0, 128) == MIN_STEPS  # a slow one still trains enough to learn
    rate = 128 * 750 / TRAIN_SECONDS  # 750 steps fit: rounded down to the quantum
    assert choose_steps(rate, 128) == 700 and 700 % STEP_QUANTUM == 0
    assert choose_steps(rate * 1.01, 128) == choose_steps(rate * 1.05, 128)  # small jitter, same count


@pytest.mark.slow
def test_the_probe_times_the_demo_run_itself_and_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """The step count comes from a short run of the demo's own config on its own data (loader
    worker included): the rate is the samples of the timed steps, those after the warm-up, over the
    time the run took for them. It prints nothing, keeps no run folder, and a mistake in the config
    stops it with the run's own error rather than a rate."""
    import time

    from vltrain.demo import prepare_data, probe_rate
    from vltrain.errors import UserError
    from vltrain.train import metrics

    data = tmp_path / "shapes"
    tokenizer = prepare_data(data, num=200, val=20)
    capsys.readouterr()
    given = [f"data.train={data / 'train.jsonl'}", f"data.tokenizer={tokenizer}", "data.batch_size=16",
             "train.threads=1", f"run.dir={tmp_path / 'run'}"]
    records = []

    def read_jsonl(path):  # keeps the rows of the last read: the probe's, of its run's metrics.jsonl
        rows = read_jsonl_as_written(path)
        records[:] = [r for r in rows if "loss" in r]
        return rows

    read_jsonl_as_written = metrics.read_jsonl
    monkeypatch.setattr(metrics, "read_jsonl", read_jsonl)
    start = time.perf_counter()
    rate = probe_rate(given, steps=3, warmup=2)
    took = time.perf_counter() - start
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    timed = records[2:]
    # the run's own clock: 3 steps of 16 samples between the log lines of steps 2 and 5
    assert rate == pytest.approx(3 * 16 / (timed[-1]["time"] - records[1]["time"]), rel=0.1)
    assert rate == pytest.approx(len(timed) / sum(1 / r["samples_per_s"] for r in timed), rel=1e-9)
    assert rate > 3 * 16 / took  # the timed steps are a part of the call
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="nothing.jsonl"):
        probe_rate([*given, f"data.train={data / 'nothing.jsonl'}"], steps=1, warmup=1)
