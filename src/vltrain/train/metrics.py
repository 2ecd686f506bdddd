"""What a run reports while it trains: progress bar, metrics.jsonl, TensorBoard, curves.png.

Only rank 0 writes. Throughput and data-wait are measured between log steps from wall time
around the loader and the step; MFU is model FLOPs per second over the device's peak, taken
from a table for known GPUs or measured once per CPU with a large matmul in the run's dtype (and
kept in the user cache: ``cached_cpu_peak``).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vltrain.errors import UserError

# dense bf16/fp16 tensor-core peaks, FLOP/s (vendor data sheets, without sparsity)
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "4090": 165e12,
    "3090": 71e12,
}

_CPU_PEAK: dict[torch.dtype, float] = {}


def measure_cpu_peak(dtype: torch.dtype = torch.bfloat16, n: int = 1024, seconds: float = 0.5,
                     windows: int = 5) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` on this process's threads (measured once, cached): the
    best of ``windows`` timings, since a start-up shared with other processes (the loader's workers,
    another rank, a test suite) slows some of them. Each window is timed by the clock and by the
    CPU time its threads got, whichever gives the higher rate: on 2 cores busy with two other
    processes, the clock read 0.45 of the quiet peak and the CPU time 0.88 of it
    (``docs/benchmarks/cpu-training.md#the-cpu-peak-behind-mfu``). :class:`Throughput` raises it further if a
    step beats it."""
    if dtype in _CPU_PEAK:
        return _CPU_PEAK[dtype]
    best = max(max(rates) for rates in matmul_windows(dtype, n, seconds / windows, windows))
    _CPU_PEAK[dtype] = best
    return best


PROBE_N = 256
"""The size of the first, timed product, from which :func:`matmul_windows` sizes the others."""


def matmul_windows(dtype: torch.dtype, n: int, seconds: float, windows: int) -> list[tuple[float, float]]:
    """(by the clock, by the CPU time its threads got) FLOP/s of n x n matmuls in ``dtype``, for each
    of ``windows`` windows of ``seconds``. Where one n x n product would not fit in a window (a CPU
    that emulates ``dtype``: 2.8 s for n = 1024 in bf16 or fp16 on an AVX2-only EPYC, against 30 ms
    in fp32), n is halved until it does, as a first timed product of ``PROBE_N`` foretells: else
    the warm-up and the five windows' single products took 17 s."""
    draw = torch.Generator().manual_seed(0)  # the run's own generators are left as they are
    probe = min(n, PROBE_N)
    a = torch.randn(probe, probe, generator=draw).to(dtype)
    a @ a  # warm-up (oneDNN picks its kernel on first use)
    start = time.perf_counter()
    a @ a
    rate = 2 * probe**3 / max(time.perf_counter() - start, 1e-9)
    while n > probe and 2 * n**3 / rate > seconds:
        n //= 2
    a = torch.randn(n, n, generator=draw).to(dtype)
    b = torch.randn(n, n, generator=draw).to(dtype)
    a @ b  # warm-up at this size
    return time_products(a, b, seconds, windows)


def time_products(a: torch.Tensor, b: torch.Tensor, seconds: float, windows: int) -> list[tuple[float, float]]:
    """(by the clock, by the CPU time its threads got) FLOP/s of ``a @ b`` (square), for each of
    ``windows`` windows of ``seconds``; a window holds at least one product."""
    n, threads, out = a.shape[0], torch.get_num_threads(), []
    for _ in range(windows):
        reps, start, cpu = 0, time.perf_counter(), time.process_time()
        while reps == 0 or time.perf_counter() - start < seconds:
            a @ b
            reps += 1
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        flops = 2 * n**3 * reps
        out.append((flops / max(wall, 1e-9), flops / max(cpu / threads, 1e-9)))
    return out


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The instructions a CPU matmul's speed depends on; with the model name they key the cached peak."""


def peak_cache_path() -> Path:
    """The user cache's table of measured CPU peaks (beside the shard index's)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vltrain" / "cpu-peak.json"


PEAK_METHOD = "clock-or-cpu-time"
"""How the kept peaks were timed: part of their key, so peaks an older method kept (by the clock
alone, too low when first timed on a busy machine) are timed again."""


def cpu_key(dtype: torch.dtype) -> str:
    """This machine's CPU (model name and matmul instructions), threads, dtype and torch version."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    have = "+".join(f for f in CPU_FLAGS if f in flags) or "-"
    return f"{name} [{have}] {torch.get_num_threads()} threads {dtype} torch {torch.__version__} {PEAK_METHOD}"


def cached_cpu_peak(dtype: torch.dtype) -> float:
    """:func:`measure_cpu_peak`, measured once per machine rather than once per run: the first run
    on a CPU (by :func:`cpu_key`) times it and keeps it in the user cache, later ones read it (the
    timing takes 0.6 s, where the CPU emulates the dtype too). A run whose steps beat it raises the
    kept value (:func:`raise_cpu_peak`), so a peak first timed on a busy machine heals. A cache that
    cannot be read or written only means measuring again."""
    key = cpu_key(dtype)
    known = _read_peaks().get(key)
    if isinstance(known, (int, float)) and known > 0:
        return _CPU_PEAK.setdefault(dtype, float(known))
    peak = measure_cpu_peak(dtype)
    _keep_peak(key, peak)
    return peak


def raise_cpu_peak(dtype: torch.dtype, rate: float) -> None:
    """Keep ``rate`` FLOP/s as this CPU's peak in ``dtype`` if it beats the kept one."""
    _CPU_PEAK[dtype] = max(_CPU_PEAK.get(dtype, 0.0), rate)
    _keep_peak(cpu_key(dtype), rate)


def _read_peaks() -> dict:
    try:
        table = json.loads(peak_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _keep_peak(key: str, peak: float) -> None:
    """Write ``peak`` under ``key`` unless a higher one is kept there already."""
    path, table = peak_cache_path(), _read_peaks()
    if isinstance(table.get(key), (int, float)) and table[key] >= peak:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps({**table, key: peak}, indent=1) + "\n")
        os.replace(tmp, path)  # whole or not at all, with another process writing beside this one
    except OSError:
        pass


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops if dtype != torch.float32 else flops / 2  # tf32 peaks are half
        return float("nan")
    return cached_cpu_peak(dtype)


def memory_bytes(device: torch.device) -> int:
    """CUDA memory allocated now, or this process's resident set size now (Linux; elsewhere 0).

    On a CPU the resident size includes what the C allocator keeps of freed memory for reuse
    (``keep_freed_memory``): it grows over the first hundreds of steps and then levels off while
    the memory in use stays flat (docs/benchmarks/memory.md#resident-memory-over-a-run)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated since the last reset, or this process's peak resident set size (the
    most it has held, as the CUDA figure is: the current size rises and falls within a step)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class GpuUtilization:
    """GPU busy percentage through NVML (the optional ``nvidia-ml-py``); None when unavailable."""

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # package missing or no driver access: the metric is simply absent
            self.handle = None

    def read(self) -> float | None:
        if self.handle is None:
            return None
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)


class Throughput:
    """Samples/s, data-wait fraction and MFU over the window since the last log step.

    ``measured``: the peak was timed on this machine (a CPU), not read from a data sheet. A timed
    peak can fall short of what the model's own matmuls reach (a start-up under load, a shape the
    library runs better), so it rises to any window's rate above it: MFU never reads over 100%."""

    def __init__(self, peak: float, measured: bool = False, dtype: torch.dtype | None = None):
        """``dtype``: with ``measured``, a window that beats the peak raises the CPU's kept one
        (:func:`raise_cpu_peak`)."""
        self.peak, self.measured, self.dtype = peak, measured, dtype
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.wait = 0.0
        self.samples = 0
        self.flops = 0.0

    def add(self, samples: int, data_wait_s: float, flops: float = 0.0) -> None:
        """``samples`` of the whole step (all ranks); ``flops`` of this rank's share of it."""
        self.samples += samples
        self.wait += data_wait_s
        self.flops += flops

    def read(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {"samples_per_s": self.samples / elapsed, "data_wait": self.wait / elapsed}
        if self.flops and self.peak and not math.isnan(self.peak):
            if self.measured and self.flops / elapsed > self.peak:
                self.peak = self.flops / elapsed
                if self.dtype is not None:
                    raise_cpu_peak(self.dtype, self.peak)
            out["mfu"] = self.flops / elapsed / self.peak
        return out


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def log_line(step: int, total: int, values: dict[str, Any], eta_s: float | None) -> str:
    """The line a log without a progress bar gets every ``train.log_every`` steps."""
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}"]
    objectives = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in values.items() if k.startswith("loss/")]
    if objectives:
        parts[-1] += f" ({', '.join(objectives)})"
    if "lr" in values:
        parts.append(f"lr {values['lr']:.2e}")
    if "samples_per_s" in values:
        parts.append(f"{values['samples_per_s']:,.0f} samples/s")
    if "data_wait" in values:
        parts.append(f"data wait {100 * values['data_wait']:.0f}%")
    if "mfu" in values:
        parts.append(f"MFU {100 * values['mfu']:.1f}%")
    if values.get("memory_gb") and "peak_memory_gb" in values:
        parts.append(f"mem {values['memory_gb']:.2f} GiB (peak {values['peak_memory_gb']:.2f})")
    elif "peak_memory_gb" in values:
        parts.append(f"mem {values['peak_memory_gb']:.2f} GiB")
    if values.get("skipped"):
        parts.append("step skipped")
    parts.append(f"ETA {_duration(eta_s)}" if eta_s is not None else "ETA -")
    return " | ".join(parts)


class WandbSink:
    """A Weights & Biases run in RUN_DIR/wandb, resumed by the id kept in RUN_DIR/wandb_id."""

    def __init__(self, run_dir: Path, settings: Any, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("metrics.wandb: true needs the wandb package: pip install 'vltrain[wandb]' "
                            "(or set metrics.wandb=false)") from None
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        name = settings.wandb_name or config.get("run", {}).get("name") or run_dir.name
        self.run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity or None, name=name,
                              tags=list(settings.wandb_tags) or None, id=run_id, resume="allow", dir=str(run_dir),
                              config=config)

    def log(self, step: int, values: dict[str, Any]) -> None:
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Rank 0's sinks. Other ranks get one with ``enabled=False`` that does nothing."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, total_steps: int, progress: bool = True,
                 start_step: int = 0, wandb: Any = None, config: dict[str, Any] | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.bar = self.tb = self.jsonl = self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # a run that starts from step s replays every step after it: the records a stopped run made
        # past its checkpoint go, so each step is recorded once (TensorBoard purges its own)
        drop_records_after(self.run_dir / "metrics.jsonl", start_step)
        drop_records_after(self.run_dir / "eval.json", start_step)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        except ImportError:
            self.tb = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, unit="step")
        self.total_steps = total_steps
        self.clock = (time.perf_counter(), start_step)  # for the ETA of the log lines
        if wandb is not None and wandb.wandb:
            self.wandb = WandbSink(self.run_dir, wandb, config or {})

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), **values}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(step, values)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{values.get('loss', float('nan')):.4f}",
                sps=f"{values.get('samples_per_s', 0):.0f}",
                refresh=False,
            )
        elif "loss" in values:  # no bar (Slurm, nohup, a pipe): one line per logged step
            start, first = self.clock
            done = step - first
            eta = (time.perf_counter() - start) / done * (self.total_steps - step) if done > 0 else None
            print(log_line(step, self.total_steps, values, eta), file=sys.stderr, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def write(self, text: str) -> None:
        """A line of text that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        for sink in (self.bar, self.tb, self.jsonl, self.wandb):
            if sink is not None:
                sink.close()
        self.bar = self.tb = self.jsonl = self.wandb = None


def drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``metrics.jsonl`` (a record a line) or ``eval.json`` (a list) without the records of
    steps after ``step``; atomically, so a crash leaves the old file or the new one."""
    if not path.exists():
        return
    text = path.read_text()
    if path.suffix == ".jsonl":
        lines = [line for line in text.splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        if len(kept) == len(lines):
            return
        new = "".join(line + "\n" for line in kept)
    else:
        history = json.loads(text)
        kept = [h for h in history if h.get("step", 0) <= step]
        if len(kept) == len(history):
            return
        new = json.dumps(kept, indent=1) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def restart_cost(path: Path, step: int) -> str:
    """What resuming at ``step`` costs, from ``metrics.jsonl`` before a resume drops its later
    records: the seconds since the run logged ``step`` (or the last step it logged before), and
    the logged steps past it that are trained again. "" without such a record."""
    records = [r for r in read_jsonl(path) if "time" in r and "step" in r]
    before = [r for r in records if r["step"] <= step]
    if not before:
        return ""
    at = max(before, key=lambda r: r["step"])
    again = max((r["step"] for r in records), default=step) - step
    since = "" if at["step"] == step else f" (the last step logged before it: {at['step']})"
    return (f"{time.time() - at['time']:.1f} s since step {at['step']} was trained{since}, "
            f"{max(again, 0)} step(s) trained again")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


EVAL_CURVES = ("i2t_r1", "t2i_r1", "i2t_r5", "t2i_r5")
"""The val recalls drawn; each zero-shot and retrieval set adds its headline figure."""


def _plot_evals(ax, evals: list[dict[str, Any]]) -> None:
    """Val recall and every evaluation set's headline figure (zero-shot top-1, retrieval t2i R@1)."""
    keys = [k for k in EVAL_CURVES if any(k in e for e in evals)]
    keys += sorted({k for e in evals for k in e if k.startswith(("zeroshot/", "retrieval/"))
                    and k.endswith(("/top1", "/t2i_r1"))})
    for k in keys:
        points = [(e["step"], e[k]) for e in evals if k in e]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=k)
    if keys:
        ax.legend(fontsize=8)
        ax.set_ylim(0, 1)
    ax.set_title("evaluation")


def plot_curves(run_dir: str | Path) -> Path | None:
    """RUN_DIR/curves.png: loss, lr, throughput and eval metrics against the step."""
    run_dir = Path(run_dir)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]  # training log steps
    if not rows:
        return None
    evals_path = run_dir / "eval.json"
    evals = json.loads(evals_path.read_text()) if evals_path.exists() else []
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    steps = [r["step"] for r in rows]

    ax = axes[0][0]
    ax.plot(steps, [r.get("loss") for r in rows], label="loss")
    loss_keys = sorted({k for r in rows for k in r if k.startswith("loss/")})
    for k in loss_keys:
        ax.plot(steps, [r.get(k) for r in rows], label=k.split("/", 1)[1], alpha=0.7)
    ax.set_title("loss")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    ax.plot(steps, [r.get("lr") for r in rows])
    ax.set_title("learning rate")

    ax = axes[1][0]
    ax.plot(steps, [r.get("samples_per_s") for r in rows])
    ax.set_title("samples/s")

    _plot_evals(axes[1][1], evals)
    for row in axes:
        for a in row:
            a.set_xlabel("step")
            a.grid(alpha=0.3)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
