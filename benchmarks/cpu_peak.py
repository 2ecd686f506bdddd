"""The CPU matmul peak that MFU divides by, timed on a quiet machine and beside busy processes.

`vltrain.train.metrics.measure_cpu_peak` times each window by the clock and by the CPU time its
threads got, and keeps the higher rate. This prints both readings, quiet and with 1 and 2 other
processes spinning on the cores (a loader worker starting, another rank, a test suite), so the
error of each is seen against the quiet figure.

``--cost``: instead, what timing the peak costs a run's start in each dtype (as a first run on a
machine pays it, ``measure_cpu_peak``'s five 0.1 s windows), with the products sized to the
windows (what vltrain does) and at a fixed 1024 x 1024 (as it did: one product alone outlasts a
window where the CPU emulates the dtype), side by side, with the peak each reads.

    PYTHONPATH=src python benchmarks/cpu_peak.py [--threads 2] [--dtype fp32] [--cost]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch
from ema_demo import cpu_name

from vltrain.runtime.precision import DTYPES
from vltrain.train.metrics import matmul_windows, time_products


def spin(stop: float) -> None:
    while time.time() < stop:
        pass


def readings(dtype: torch.dtype) -> tuple[float, float]:
    """The best clock rate and the best CPU-time rate of ten 0.1 s windows, FLOP/s."""
    windows = matmul_windows(dtype, 1024, 0.1, 10)
    return max(w[0] for w in windows), max(max(w) for w in windows)


def fixed_size_peak(dtype: torch.dtype, n: int = 1024, seconds: float = 0.1, windows: int = 5) -> float:
    """The peak as it was timed before the products were sized: a warm-up and ``windows`` windows of
    n x n products, each window at least one product."""
    draw = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=draw).to(dtype) for _ in range(2))
    a @ b
    return max(max(w) for w in time_products(a, b, seconds, windows))


def cost() -> None:
    """Seconds to time the peak, sized against fixed, in each dtype."""
    print("| dtype | sized: seconds | sized: GFLOP/s | fixed 1024: seconds | fixed 1024: GFLOP/s | fixed / sized (time) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("fp32", "bf16", "fp16"):
        dtype = DTYPES[name]
        start = time.perf_counter()
        sized = max(max(w) for w in matmul_windows(dtype, 1024, 0.1, 5))
        t_sized = time.perf_counter() - start
        start = time.perf_counter()
        fixed = fixed_size_peak(dtype)
        t_fixed = time.perf_counter() - start
        print(f"| {name} | {t_sized:.2f} | {sized / 1e9:.1f} | {t_fixed:.2f} | {fixed / 1e9:.1f} | {t_fixed / t_sized:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--cost", action="store_true", help="time the peak's timing in each dtype instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cost:
        print(f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}\n")
        cost()
        return
    dtype = DTYPES[args.dtype]
    print(f"{cpu_name()}, {args.threads} threads, {args.dtype}, torch {torch.__version__}\n")
    print("| other busy processes | clock (GFLOP/s) | clock / quiet | CPU time (GFLOP/s) | CPU time / quiet |")
    print("|---:|---:|---:|---:|---:|")
    quiet = None
    for busy in (0, 1, 2):
        stop = time.time() + 30
        spinners = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(busy)]
        for p in spinners:
            p.start()
        time.sleep(0.3)
        clock, cpu = readings(dtype)
        for p in spinners:
            p.terminate()
            p.join()
        quiet = quiet or cpu
        print(f"| {busy} | {clock / 1e9:.1f} | {clock / quiet:.2f} | {cpu / 1e9:.1f} | {cpu / quiet:.2f} |")


if __name__ == "__main__":
    main()
