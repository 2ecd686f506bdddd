"""CLIP ViT-B/16 on one GPU: the step alone, the whole loop, the loader alone, and data wait.

The trainer's own step (``Trainer.train_step``: bf16 autocast, fused AdamW, gradient clipping,
the per-step finiteness all-reduce) is timed with the real data path: photo-like JPEGs and
captions written here, a tokenizer trained on them, ``build_dataset`` + ``build_train_loader``
+ ``Collator`` with pinned memory and loader workers, uint8 images normalized on the device.
The manifest reuses the written images under new ids so that an epoch holds
``--batches-per-epoch`` batches (40: steady state, not a loop crossing an epoch boundary every
few steps). For ``train.compile`` off and on it searches the largest micro-batch that fits
(512, 384, 256, ... until one survives two steps without ``torch.cuda.OutOfMemoryError``).

Rows per setting:
- step alone: ``train_step`` on one batch already loaded, synchronized after each step;
- whole loop: the loader feeding the step, as training runs (samples/s, MFU);
- loader alone: ms per batch the loader's workers supply with nothing else running;
- data wait: the loop's time in ``next(loader)`` over its wall time.

MFU = model FLOPs per second (``flops_per_sample`` at each batch's padded text width: forward
+ backward matmuls) over the dense bf16 peak (989 TFLOP/s on H100/H200 SXM). Targets on one H100:
MFU >= 40%, data wait <= 5%.

``--simulate-step-ms MS`` needs no GPU: the real loader feeds a step that sleeps MS (0: 1.25x
the time the loader alone takes per batch, i.e. a step consuming 80% of what the workers
supply), at 40 and at 4 batches per epoch (``_loop_sim.py``).

    PYTHONPATH=src python benchmarks/gpu_clip.py [--images 2000] [--steps 40] [--workers 12] [--patch-dropout 0.5]
    PYTHONPATH=src python benchmarks/gpu_clip.py --device cpu --tiny      # a smoke run, no figures
    PYTHONPATH=src python benchmarks/gpu_clip.py --device cpu --simulate-step-ms 0 --workers 2
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _loop_sim import repeat_manifest, simulate
from data_pipeline import make_data, read_manifest

from vltrain.config.job import load_config
from vltrain.data.tools.tokenizer_training import train_tokenizer
from vltrain.train.metrics import peak_memory_bytes
from vltrain.train.trainer import Trainer

CANDIDATES = (512, 384, 256, 192, 128, 96, 64, 32, 16, 8)


@dataclass
class Result:
    compile: bool
    batch: int
    samples_per_s: float
    mfu: float
    data_wait: float
    step_ms: float
    step_alone_ms: float
    loader_alone_ms: float
    peak_gb: float
    compile_s: float


def job_overrides(args, data: Path, run_dir: Path, batch: int, compiled: bool) -> list[str]:
    tiny = args.tiny
    manifest = data / f"epoch-{batch}.jsonl"
    if not manifest.exists():
        repeat_manifest(data, args.batches_per_epoch * batch, manifest.name)
    return [
        f"run.dir={run_dir}",
        f"data.train={manifest}",
        f"data.tokenizer={data / 'tokenizer.json'}",
        f"data.image_size={64 if tiny else 224}",
        f"data.max_text_length={32 if tiny else 77}",
        f"data.batch_size={batch}",
        "data.batching=fixed",
        f"data.num_workers={args.workers}",
        f"data.prefetch_factor={args.prefetch}",
        f"model.preset={'tiny-clip' if tiny else 'clip-vit-b16'}",
        f"train.device={args.device}",
        f"train.precision={args.precision}",
        f"train.compile={str(compiled).lower()}",
        f"train.activation_checkpointing={str(args.checkpointing).lower()}",
        f"train.max_steps={args.warmup + args.steps + 10}",
        "train.warmup_steps=10",
        "train.progress=false",
        "train.resume=never",
        f"train.threads={args.threads}",
    ] + ([f"model.vision.patch_dropout={args.patch_dropout}"] if args.patch_dropout else [])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(trainer: Trainer, steps: int) -> None:
    """The loop's own steps; samples reach the throughput meter when the trainer settles."""
    for _ in range(steps):
        micro, wait = trainer._next_micro_batches()
        trainer.train_step(micro)
        trainer.throughput.add(0, wait, trainer._flops(micro, trainer.step))
    trainer.settle()


def step_alone_ms(trainer: Trainer, steps: int, device: torch.device) -> float:
    """One loaded batch stepped ``steps`` times, synchronized each step: no loader in the way."""
    micro, _ = trainer._next_micro_batches()
    total = 0.0
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        trainer.train_step(micro)
        sync(device)
        total += time.perf_counter() - start
    trainer.settle()
    return 1000 * total / steps


def loader_alone_ms(trainer: Trainer, batches: int) -> float:
    """Ms per batch the trainer's loader supplies with no step running (its workers warm)."""
    start = time.perf_counter()
    for _ in range(batches):
        next(trainer.loader)
    return 1000 * (time.perf_counter() - start) / batches


def release(device: torch.device) -> None:
    """Collect a dropped trainer (it holds reference cycles) and hand its GPU memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fits(args, data: Path, batch: int, compiled: bool, device: torch.device) -> bool:
    """Whether two steps (the second one with optimizer state allocated) run at this micro-batch."""
    trainer, ok = None, True
    try:
        trainer = Trainer(load_config(None, job_overrides(args, data, Path(args.tmp) / "probe", batch, compiled)))
        run_steps(trainer, 2)
        sync(device)
    except torch.cuda.OutOfMemoryError:
        ok = False
    # outside the except block, so that the traceback no longer holds the step's tensors
    if trainer is not None:
        trainer.close()
    trainer = None
    release(device)
    return ok


def largest_batch(args, data: Path, compiled: bool, device: torch.device) -> int:
    if args.batch:
        return args.batch
    if device.type != "cuda":
        return 16
    for batch in CANDIDATES:
        if fits(args, data, batch, compiled, device):
            return batch
        print(f"  compile={compiled}: micro-batch {batch} does not fit", flush=True)
    raise SystemExit("not even a micro-batch of 8 fits on this GPU")


def measure(args, data: Path, batch: int, compiled: bool, device: torch.device) -> Result:
    trainer = Trainer(load_config(None, job_overrides(args, data, Path(args.tmp) / f"run-{compiled}", batch, compiled)))
    start = time.perf_counter()
    run_steps(trainer, args.warmup)  # compilation, cuDNN/cuBLAS autotuning, loader workers filling up
    sync(device)
    compile_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.throughput.reset()
    start = time.perf_counter()
    run_steps(trainer, args.steps)
    sync(device)
    elapsed = time.perf_counter() - start
    read = trainer.throughput.read()
    alone = step_alone_ms(trainer, args.steps, device)
    time.sleep(2)  # the workers refill their prefetch queue before the loader is timed alone
    supply = loader_alone_ms(trainer, args.steps)
    result = Result(compiled, batch, read["samples_per_s"], read.get("mfu", float("nan")), read["data_wait"],
                    1000 * elapsed / args.steps, alone, supply, peak_memory_bytes(device) / 2**30, compile_s)
    trainer.close()
    trainer = None
    release(device)
    return result


def write_data(folder: Path, images: int) -> Path:
    """Photo-like 500x375 JPEGs (quality 90) with 5-40 word captions, and a WordPiece tokenizer."""
    manifest = make_data(folder, images)
    texts = (r["text"] for r in read_manifest(manifest))
    train_tokenizer(texts, folder / "tokenizer.json", vocab_size=1000, kind="wordpiece", min_frequency=1)
    return folder


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny-clip at 64x64, few images and steps (a smoke run)")
    p.add_argument("--images", type=int, default=2000, help="distinct JPEGs written (the manifest reuses them)")
    p.add_argument("--batches-per-epoch", type=int, default=40)
    p.add_argument("--steps", type=int, default=40, help="measured steps per setting")
    p.add_argument("--warmup", type=int, default=5, help="steps before measuring (compilation happens here)")
    p.add_argument("--batch", type=int, default=0, help="micro-batch (0: the largest that fits)")
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing (bigger batches fit)")
    p.add_argument("--compile", default="off,on", help="compile settings to measure: off, on or off,on")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--patch-dropout", type=float, default=0.0,
                   help="model.vision.patch_dropout: the fraction of image patches each step drops (FLIP)")
    p.add_argument("--simulate-step-ms", type=float, default=None,
                   help="no model: the loader feeds a step sleeping this long (0: at 80%% of the loader's supply)")
    p.add_argument("--sleep-per-sample-ms", type=float, default=0.0,
                   help="with --simulate-step-ms: workers sleep this long per sample instead of decoding")
    args = p.parse_args()
    if args.tiny:
        args.images, args.steps, args.warmup = min(args.images, 64), min(args.steps, 4), min(args.warmup, 2)
    return args


def print_simulation(args, rows: list[dict]) -> None:
    source = (f"samples that sleep {args.sleep_per_sample_ms} ms" if args.sleep_per_sample_ms > 0
              else f"500x375 JPEGs to {64 if args.tiny else 224}")
    print(f"\nsimulated step: the real loader ({args.workers} workers, prefetch {args.prefetch}, micro-batch "
          f"{args.batch or 16}, {source}) feeding a sleeping step; "
          f"{args.steps} measured steps, CPU ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}")
    print("| batches per epoch | loader alone ms/batch | step ms | data wait |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['epoch']} | {r['alone_ms']:.1f} | {r['step_ms']:.1f} | {r['wait']:.1%} |")


def print_results(args, results: list[Result], device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    model = "tiny-clip 64x64" if args.tiny else "clip-vit-b16 224x224"
    print(f"\n{model}, {args.precision}, {name}, torch {torch.__version__}, {args.workers} loader workers, "
          f"{args.batches_per_epoch} batches per epoch, {args.steps} measured steps after {args.warmup}, "
          f"patch dropout {args.patch_dropout}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| compile | micro-batch | step alone ms | whole loop ms | samples/s | MFU | loader alone ms/batch "
          "| data wait | peak GiB | warm-up s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {'on' if r.compile else 'off'} | {r.batch} | {r.step_alone_ms:.0f} | {r.step_ms:.0f} | "
              f"{r.samples_per_s:.1f} | {r.mfu:.1%} | {r.loader_alone_ms:.0f} | {r.data_wait:.1%} | "
              f"{r.peak_gb:.1f} | {r.compile_s:.0f} |")
    if device.type == "cpu":
        print("(CPU smoke run: MFU is against this CPU's measured matmul peak; not a GPU figure)")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    simulating = args.simulate_step_ms is not None
    if device.type == "cuda" and not torch.cuda.is_available() and not simulating:
        raise SystemExit("no CUDA device here; use --device cpu --tiny for a smoke run, or --simulate-step-ms")
    settings = [s.strip() == "on" for s in args.compile.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        start = time.perf_counter()
        data = write_data(Path(tmp) / "data", args.images)
        print(f"wrote {args.images} JPEGs (500x375) and a tokenizer in {time.perf_counter() - start:.0f} s", flush=True)
        if simulating:
            batch = args.batch or 16
            print_simulation(args, simulate(job_overrides(args, data, Path(tmp) / "sim", batch, False), data, batch, args))
            return
        results = []
        for compiled in settings:
            batch = largest_batch(args, data, compiled, device)
            print(f"  compile={compiled}: micro-batch {batch}", flush=True)
            results.append(measure(args, data, batch, compiled, device))
    print_results(args, results, device)


if __name__ == "__main__":
    main()
