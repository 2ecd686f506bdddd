"""Metric sinks: metrics.jsonl, TensorBoard events, curves.png, throughput figures."""

from __future__ import annotations

import json
import time

import pytest
import torch

from vltrain.train.metrics import MetricsLogger, Throughput, measure_cpu_peak, peak_memory_bytes, plot_curves


def test_logger_writes_jsonl_tensorboard_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, enabled=True, total_steps=3, progress=True)
    for step in (1, 2, 3):
        log.log(step, {"loss": 3.0 - step, "loss/itc": 1.0, "lr": 0.1 * step, "samples_per_s": 10.0})
    log.close()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["loss"] == 2.0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    (tmp_path / "eval.json").write_text(json.dumps([{"step": 3, "t2i_r1": 0.5, "i2t_r1": 0.4}]))
    out = plot_curves(tmp_path)
    assert out is not None and out.stat().st_size > 1000


def test_a_resumed_run_records_each_step_once(tmp_path):
    """A run killed at step 6 whose checkpoint is step 4: the restarted logger drops steps 5 and 6
    (metrics.jsonl, eval.json) and purges them from TensorBoard, then logs them again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, enabled=True, total_steps=8, progress=False)
    for step in range(1, 7):
        log.log(step, {"loss": float(step)})
    log.close()
    (tmp_path / "eval.json").write_text(json.dumps([{"step": 4, "t2i_r1": 0.1}, {"step": 6, "t2i_r1": 0.2}]))
    time.sleep(1.1)  # TensorBoard names event files by the second
    log = MetricsLogger(tmp_path, enabled=True, total_steps=8, progress=False, start_step=4)
    for step in range(5, 9):
        log.log(step, {"loss": 10.0 + step})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows][4:] == [15.0, 16.0, 17.0, 18.0]
    assert [e["step"] for e in json.loads((tmp_path / "eval.json").read_text())] == [4]
    events = EventAccumulator(str(tmp_path / "tb"), purge_orphaned_data=True)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(s, float(s)) for s in range(1, 5)] + [(s, 10.0 + s) for s in range(5, 9)]


def test_the_plot_draws_every_evaluation_sets_figure(tmp_path, monkeypatch):
    import matplotlib.axes

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 0.1}) + "\n")
    (tmp_path / "eval.json").write_text(json.dumps([
        {"step": 1, "t2i_r1": 0.5, "zeroshot/pets/top1": 0.3, "zeroshot/pets/num_images": 30},
        {"step": 2, "t2i_r1": 0.6, "zeroshot/pets/top1": 0.4, "retrieval/coco/t2i_r1": 0.2}]))
    drawn = []
    real = matplotlib.axes.Axes.plot

    def plot(ax, *args, label=None, **kwargs):
        drawn.append(label)
        return real(ax, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    plot_curves(tmp_path)
    assert {"t2i_r1", "zeroshot/pets/top1", "retrieval/coco/t2i_r1"} <= set(drawn)


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "r", enabled=False, total_steps=3)
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "r").exists()


def test_throughput_and_mfu():
    t = Throughput(peak=1e9)
    t.add(samples=100, data_wait_s=0.0, flops=1e6)
    time.sleep(0.05)
    r = t.read()
    assert 0 < r["samples_per_s"] <= 100 / 0.05
    assert 0 < r["mfu"] < 1e6 / 0.05 / 1e9 + 1e-9
    assert r["data_wait"] == 0.0


def test_cpu_peak_is_a_matmul_rate_and_peak_memory_follows_an_allocation():
    """The peak is at least what a plain timed matmul loop reaches (it takes the best window, by
    the clock or by CPU time); the resident peak rises past a buffer larger than the peak so far."""
    import time

    a = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    plain = 20 * 2 * 128**3 / (time.perf_counter() - start)
    assert measure_cpu_peak(torch.float32, n=128, seconds=0.05) >= 0.5 * plain
    before = peak_memory_bytes(torch.device("cpu"))
    held = torch.ones(before + 64 * 2**20, dtype=torch.uint8)  # written, so resident: past the peak so far
    assert peak_memory_bytes(torch.device("cpu")) >= held.numel() > before


def test_the_cpu_peak_is_measured_once_per_machine_and_read_after(tmp_path, monkeypatch):
    from vltrain.train import metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(metrics, "_CPU_PEAK", {})
    timed = []
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda dtype: timed.append(dtype) or 123e9)
    state = torch.random.get_rng_state()
    assert metrics.peak_flops(torch.device("cpu"), torch.bfloat16) == 123e9 and timed == [torch.bfloat16]
    table = json.loads((tmp_path / "vltrain" / "cpu-peak.json").read_text())
    assert table == {metrics.cpu_key(torch.bfloat16): 123e9}
    assert "threads torch.bfloat16 torch " in metrics.cpu_key(torch.bfloat16)
    monkeypatch.setattr(metrics, "_CPU_PEAK", {})  # a new process on the same machine
    assert metrics.peak_flops(torch.device("cpu"), torch.bfloat16) == 123e9 and timed == [torch.bfloat16]
    assert metrics.peak_flops(torch.device("cpu"), torch.float32) == 123e9 and timed[-1] == torch.float32
    assert len(json.loads((tmp_path / "vltrain" / "cpu-peak.json").read_text())) == 2
    (tmp_path / "vltrain" / "cpu-peak.json").write_text("{not json")  # a broken cache: measured again
    monkeypatch.setattr(metrics, "_CPU_PEAK", {})
    assert metrics.peak_flops(torch.device("cpu"), torch.float32) == 123e9 and len(timed) == 3
    assert torch.equal(torch.random.get_rng_state(), state)
    monkeypatch.undo()
    state = torch.random.get_rng_state()
    metrics.measure_cpu_peak(torch.float64, n=64, seconds=0.01)  # its matrices come from a generator of its own
    assert torch.equal(torch.random.get_rng_state(), state)


def test_current_memory_follows_what_the_process_holds():
    from vltrain.train.metrics import memory_bytes

    import mmap

    cpu = torch.device("cpu")
    before = memory_bytes(cpu)
    # fresh pages of their own: the C allocator may hold freed memory that an earlier test in this
    # process left resident (keep_freed_memory), which a tensor of this size would reuse unseen
    held = mmap.mmap(-1, 64 * 2**20)
    held.write(b"\1" * len(held))  # every page touched
    grown = memory_bytes(cpu) - before
    held.close()
    assert grown > 60 * 2**20
    assert memory_bytes(cpu) - before < grown - 60 * 2**20  # and given back


def test_log_line_holds_what_a_slurm_log_reader_needs():
    from vltrain.train.metrics import log_line

    line = log_line(120, 1000, {"loss": 1.23456, "loss/itc": 1.0, "loss/itm": 0.5, "lr": 9.8e-4,
                                "samples_per_s": 2345.6, "data_wait": 0.031, "mfu": 0.123,
                                "memory_gb": 0.9, "peak_memory_gb": 1.2}, eta_s=312)
    assert line == ("step 120/1000 | loss 1.2346 (itc 1.0000, itm 0.5000) | lr 9.80e-04 | 2,346 samples/s | "
                    "data wait 3% | MFU 12.3% | mem 0.90 GiB (peak 1.20) | ETA 5m12s")


def test_without_a_terminal_every_logged_step_prints_a_line_and_the_remainder_once(cli, tmp_path):
    from kits.runkit import make_shapes, overrides

    shapes = make_shapes(tmp_path / "shapes")
    args = overrides(shapes, tmp_path / "run", data__num_workers=0, train__log_every=2,
                     data__batch_size=12)  # 64 rows: 5 full steps and a padded one per epoch
    proc = cli("train", shapes / "base.yaml", *args, "train.progress=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/10" for s in (2, 4, 6, 8, 10)]
    assert all("samples/s" in line and "lr " in line and "ETA " in line for line in lines)
    assert proc.stderr.count("rows padded by repetition") == 1


def test_wandb_offline_run_holds_the_logged_keys_and_resumes_the_same_run(cli, tmp_path, monkeypatch):
    from kits.runkit import make_shapes, overrides

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    shapes = make_shapes(tmp_path / "shapes")
    run = tmp_path / "run"
    args = [*overrides(shapes, run, data__num_workers=0, train__log_every=2, train__max_steps=4), "metrics.wandb=true",
            "metrics.wandb_tags=[tiny]", f"data.val={shapes / 'val.jsonl'}", "eval.every=2"]
    first = cli("train", shapes / "base.yaml", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = (run / "wandb_id").read_text().strip()
    (folder,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    logged = (folder / f"run-{run_id}.wandb").read_bytes()
    for key in (b"loss/itc", b"samples_per_s", b"eval/t2i_r1", b"max_steps"):  # scalars, evals, config
        assert key in logged, key
    again = cli("train", shapes / "base.yaml", *args[:-1], "train.max_steps=6", "eval.every=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run / "wandb_id").read_text().strip() == run_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    import pytest

    from vltrain.config.job import MetricsConfig
    from vltrain.errors import UserError
    from vltrain.train.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'vltrain\[wandb\]'"):
        MetricsLogger(tmp_path, enabled=True, total_steps=1, wandb=MetricsConfig(wandb=True))


def test_a_restart_says_what_it_cost_from_the_records_past_the_checkpoint(tmp_path):
    from vltrain.train.metrics import restart_cost

    path = tmp_path / "metrics.jsonl"
    now = time.time()
    path.write_text("".join(json.dumps({"step": s, "time": now - 30 + s, "loss": 1.0}) + "\n" for s in range(1, 10, 2)))
    said = restart_cost(path, 5)  # steps 1, 3, 5, 7, 9 logged; resumed at 5, logged 25 s ago
    assert said.startswith("2") and " s since step 5 was trained, 4 step(s) trained again" in said
    assert float(said.split(" s since")[0]) == pytest.approx(25, abs=2)
    assert "(the last step logged before it: 3)" in restart_cost(path, 4)
    assert restart_cost(path, 0) == "" and restart_cost(tmp_path / "missing.jsonl", 5) == ""


def test_mfu_on_a_timed_peak_never_reads_over_100_percent():
    t = Throughput(peak=1e6, measured=True)  # a peak timed low, under load
    t.add(samples=10, data_wait_s=0.0, flops=1e9)
    time.sleep(0.05)
    first = t.read()
    assert first["mfu"] == pytest.approx(1.0) and t.peak > 1e6  # the step's rate is the new peak
    t.reset()
    t.add(samples=10, data_wait_s=0.0, flops=1e7)
    time.sleep(0.05)
    assert 0 < t.read()["mfu"] < 0.5
    sheet = Throughput(peak=1e6)  # a data sheet's peak (a GPU) is not moved
    sheet.add(samples=10, data_wait_s=0.0, flops=1e9)
    time.sleep(0.05)
    assert sheet.read()["mfu"] > 1 and sheet.peak == 1e6


def test_a_peak_timed_low_on_a_busy_machine_is_raised_in_the_cache(tmp_path, monkeypatch):
    from vltrain.train import metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(metrics, "_CPU_PEAK", {})
    monkeypatch.setattr(metrics, "measure_cpu_peak", lambda dtype: 50e9)  # the first run, on a busy machine
    assert metrics.peak_flops(torch.device("cpu"), torch.float32) == 50e9
    t = Throughput(peak=50e9, measured=True, dtype=torch.float32)
    t.add(samples=10, data_wait_s=0.0, flops=8e9)
    time.sleep(0.05)  # at most 160 GFLOP/s: above the kept peak
    assert t.read()["mfu"] == pytest.approx(1.0)
    kept = json.loads((tmp_path / "vltrain" / "cpu-peak.json").read_text())[metrics.cpu_key(torch.float32)]
    assert kept == t.peak > 50e9
    metrics.raise_cpu_peak(torch.float32, 1e9)  # a slower window never lowers it
    monkeypatch.setattr(metrics, "_CPU_PEAK", {})  # the next process reads the raised one
    assert metrics.peak_flops(torch.device("cpu"), torch.float32) == kept
    assert metrics.PEAK_METHOD in metrics.cpu_key(torch.float32)  # peaks kept by the clock alone are timed again


def test_the_peak_counts_the_cpu_time_its_threads_got(monkeypatch):
    """Descheduled half the time (another process on the cores), a window's clock time is twice the
    CPU time per thread: the rate is taken from the CPU time, not halved."""
    from vltrain.train import metrics

    class Clock:  # each read of the clock: 10 ms later, of which the threads ran half
        wall = 0.0

        def perf_counter(self):
            self.wall += 0.01
            return self.wall

        def process_time(self):
            return self.wall * 0.5 * torch.get_num_threads()

    monkeypatch.setattr(metrics, "_CPU_PEAK", {})
    monkeypatch.setattr(metrics, "time", Clock())
    n, rate = 64, metrics.measure_cpu_peak(torch.float32, n=64, seconds=0.1, windows=1)
    # about 10 matmuls in 100 ms of clock, 50 ms of CPU time per thread
    assert rate == pytest.approx(2 * n**3 * 10 / 0.05, rel=0.15)
    assert rate > 1.5 * 2 * n**3 * 10 / 0.1  # the clock alone reads half


def test_a_product_too_slow_for_a_window_is_timed_smaller(monkeypatch):
    """Where one product of the asked size would not fit in a window (bf16 or fp16 on a CPU that
    emulates them: 2.8 s for 1024 x 1024), the windows time smaller ones, as a first product of
    PROBE_N foretells; where it fits, the size asked for is kept. The clock is made up: each read
    of it is ``step`` seconds later, so the rate by the clock shows the size that was timed."""
    from vltrain.train import metrics

    class Clock:
        def __init__(self, step):
            self.step, self.wall = step, 0.0

        def perf_counter(self):
            self.wall += self.step
            return self.wall

        def process_time(self):
            return self.wall * torch.get_num_threads()

    assert metrics.PROBE_N == 256
    monkeypatch.setattr(metrics, "time", Clock(1.0))  # the probe took 1 s: 1024 and 512 cannot fit in 0.1 s
    (by_clock, _), = metrics.matmul_windows(torch.float32, 1024, 0.1, 1)
    assert 2 * 256**3 / 3 <= by_clock <= 2 * 256**3  # one product of 256 in each 1-3 s
    monkeypatch.setattr(metrics, "time", Clock(0.001))  # 512 fits in 10 ms: 8 ms foretold
    (by_clock, _), = metrics.matmul_windows(torch.float32, 512, 0.01, 1)
    assert by_clock > 2 * 512**3 / (4 * 0.001)  # products of 512, about one per read of the clock


def test_cpu_memory_is_the_peak_not_the_current_size():
    import psutil

    before = peak_memory_bytes(torch.device("cpu"))
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    held = peak_memory_bytes(torch.device("cpu"))
    del big
    assert held >= before and held >= psutil.Process().memory_info().rss
    assert peak_memory_bytes(torch.device("cpu")) >= held  # freeing does not lower it
