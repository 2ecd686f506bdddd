"""The CPU matmul peak that MFU divides by, timed on a quiet machine and beside busy processes.

`vltrain.train.metrics.measure_cpu_peak` times each window by the clock and by the CPU time its
threads got, and keeps the higher rate. This prints both readings, quiet and with 1 and 2 other
processes spinning on the cores (a loader worker starting, another rank, a test suite), so the
error of each is seen against the quiet figure.

    PYTHONPATH=src python benchmarks/cpu_peak.py [--threads 2] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch
from ema_demo import cpu_name

from vltrain.runtime.precision import DTYPES
from vltrain.train.metrics import matmul_windows


def spin(stop: float) -> None:
    while time.time() < stop:
        pass


def readings(dtype: torch.dtype) -> tuple[float, float]:
    """The best clock rate and the best CPU-time rate of ten 0.1 s windows, FLOP/s."""
    windows = matmul_windows(dtype, 1024, 0.1, 10)
    return max(w[0] for w in windows), max(max(w) for w in windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
