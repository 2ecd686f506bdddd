"""``vltrain train``'s training path against a bare forward + backward + AdamW loop of the same
model, in fp32, side by side in one process.

vltrain: the real :class:`~vltrain.train.trainer.Trainer`, built from ``configs/demo.yaml`` with
overrides as ``vltrain train`` builds it, driven through its own ``train()`` loop: the loader's
bookkeeping, the step's keying, forward and backward, clipping, the all-reduce packet, the
non-finite guard, the scheduler, throughput and per-source metrics, a metrics line every
``--steps`` steps (the segment's last). Off: evaluation (no ``data.val``), EMA (the config's
default), checkpointing (the trainer's one save point, ``_checkpoint``, is a no-op here: ``vltrain
train`` always saves the last step, which a bare loop would not).

Bare: a deep copy of the trainer's model taken before its first step (the same weights) with the
same objectives (``build_task``), and per step: the batch to ``ModelInputs`` (uint8 pixels
normalized, as the trainer does), ``zero_grad(set_to_none=True)``, ``task(Score(inputs))``,
``loss.backward()``, ``clip_grad_norm_`` at ``train.grad_clip`` (foreach), and
``build_optimizer``'s AdamW (fused, the same two weight-decay groups, lr, betas, eps) ``.step()``.
No scheduler (a constant lr: the same work), no metrics, no guards.

Data: the shapes set (``synthesize``) at the model's image size, ``--steps`` x batch rows, collated
once up front by the trainer's own loader (``data.num_workers=0``); each segment of each side then
takes the same list of ``Batch``es in the same order. The trainer reads them through its
``TrainLoader``, whose inner iterator is replaced by one over that list, so nothing is decoded.

Timing: one warm-up segment per side (excluded), then ``--pairs`` pairs of segments of ``--steps``
steps, alternating the order (A B, then B A), so that a busy spell of a shared machine falls on both.
The ratio is vltrain's samples/s over the bare loop's in the same pair; the table gives each side's
median, the median of the pairs' ratios and their range.

    python benchmarks/bare_loop.py [--models tiny-coca-lite:128:20,clip-vit-b16:8:3] [--pairs 3]
        [--threads N (default: the machine's cores)]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _demo_model import demo_config, load_average, sync

from vltrain.compose.builders import build_task
from vltrain.train.metrics import CPU_FLAGS
from vltrain.train.optim import build_optimizer
from vltrain.compose.task import Score

DEMO_PRESET = "tiny-coca-lite"


def cpu_line() -> str:
    """``lscpu``'s model name, family and model, and the matmul instructions this CPU has."""
    fields = {}
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("Flags", "").split())
    have = ", ".join(f.upper() for f in CPU_FLAGS if f in flags) or "none of " + ", ".join(CPU_FLAGS)
    return (f"{fields.get('Model name', '?')} ({fields.get('Vendor ID', '?')}, family {fields.get('CPU family', '?')}, "
            f"model {fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs; {have}")


def make_data(work: Path, preset: str, rows: int, size: int) -> Path:
    """The shapes set and a tokenizer: the demo's (512-token BPE, a fifth text-only) for the demo
    model, image-text pairs and OpenCLIP's tokenizer (if installed) for the others."""
    from vltrain.data.tools.openclip_tokenizer import find_vocab, openclip_tokenizer
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    demo = preset == DEMO_PRESET
    synthesize(work / "shapes", rows, 0, text_only_fraction=0.2 if demo else 0.0, seed=0, image_size=size)
    tok = work / "tok.json"
    if not demo and find_vocab() is not None:
        openclip_tokenizer().save(str(tok))
    else:
        train_tokenizer(source_texts([str(work / "shapes" / "train.jsonl")]), tok, vocab_size=512)
    return tok


def build_trainer(work: Path, preset: str, batch: int, steps: int, total: int, threads: int):
    """The Trainer as ``vltrain train configs/demo.yaml OVERRIDES`` builds it, with checkpointing off."""
    from vltrain.train.trainer import Trainer

    size = demo_config().data.image_size if preset == DEMO_PRESET else 224
    tok = make_data(work, preset, steps * batch, size)
    cfg = demo_config(
        f"run.dir={work / 'run'}", f"data.train={work / 'shapes' / 'train.jsonl'}", "data.val=''", f"data.tokenizer={tok}",
        f"data.image_size={size}", f"data.batch_size={batch}", "data.num_workers=0", "data.persistent_workers=false",
        f"model.preset={preset}", "train.precision=fp32", f"train.threads={threads}", f"train.max_steps={total}",
        f"train.log_every={steps}", "train.progress=false", "eval.every=0", "checkpoint.every=0",
        "checkpoint.save_initial=never", "metrics.curves=false")
    trainer = Trainer(cfg)
    trainer._checkpoint = lambda final: None
    return trainer


def trainer_segment(trainer, batches: list) -> float:
    """Seconds of ``len(batches)`` steps of ``Trainer.train()``: a frozen copy of the config that
    stops after them, and the loader's inner iterator over ``batches``."""
    tc = trainer.cfg.train
    trainer.cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(tc, max_steps=trainer.step + len(batches)))
    trainer.loader._it = iter(batches)
    start = time.perf_counter()
    trainer.train()
    sync(trainer.device)
    return time.perf_counter() - start


class BareLoop:
    """Forward, backward, clipping and AdamW of a copy of the trainer's model (see the module's docstring)."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.device, self.data, self.clip = trainer.device, cfg.data, cfg.train.grad_clip
        model = copy.deepcopy(trainer.model)
        self.task = build_task(cfg, model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg.train)

    def segment(self, batches: list) -> float:
        start = time.perf_counter()
        for batch in batches:
            inputs = batch.to_model_inputs(self.device, self.data.mean, self.data.std)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.task(Score(inputs)).loss
            loss.backward()
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            self.optimizer.step()
        sync(self.device)
        return time.perf_counter() - start


def measure(preset: str, batch: int, steps: int, pairs: int, threads: int) -> dict:
    """One model: warm-up, then ``pairs`` interleaved pairs; samples/s of each segment of each side."""
    work = Path(tempfile.mkdtemp(prefix="vltrain-bare-"))
    trainer = build_trainer(work, preset, batch, steps, (pairs + 1) * steps, threads)
    bare = BareLoop(trainer)
    batches = [next(trainer.loader) for _ in range(steps)]
    sides = {"vltrain": lambda: trainer_segment(trainer, batches), "bare": lambda: bare.segment(batches)}
    sides["vltrain"](), sides["bare"]()  # warm-up
    rates: dict[str, list[float]] = {"vltrain": [], "bare": []}
    for r in range(pairs):
        for side in (("vltrain", "bare") if r % 2 == 0 else ("bare", "vltrain")):
            rates[side].append(steps * batch / sides[side]())
    trainer.close()
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"preset": preset, "batch": batch, "steps": steps, "params": params, "threads": torch.get_num_threads(),
            "size": trainer.cfg.data.image_size, **rates}


def row(m: dict) -> str:
    ratios = [a / b for a, b in zip(m["vltrain"], m["bare"])]
    return (f"| {m['preset']} ({m['params'] / 1e6:.1f}M, {m['size']} px) | {m['batch']} | {m['steps']} x {len(ratios)} "
            f"| {statistics.median(m['vltrain']):.1f} | {statistics.median(m['bare']):.1f} "
            f"| {statistics.median(ratios):.3f} | {min(ratios):.3f} to {max(ratios):.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=f"{DEMO_PRESET}:128:20,clip-vit-b16:8:3",
                   help="PRESET:BATCH:STEPS, comma-separated (STEPS: per segment)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved pairs of segments, after one warm-up each")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # one model, in a process of its own
    args = p.parse_args()
    if args.child:
        preset, batch, steps = args.child.split(":")
        print(json.dumps(measure(preset, int(batch), int(steps), args.pairs, args.threads)))
        return
    print(f"CPU: {cpu_line()}")
    print(f"fp32, {args.threads} threads, torch {torch.__version__}; {args.pairs} interleaved pairs of segments "
          f"after one warm-up segment each; {load_average()} at the start")
    print("| model | batch | steps x pairs | vltrain samples/s | bare samples/s | ratio (median) | ratio range |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in args.models.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", spec, "--pairs", str(args.pairs),
                              "--threads", str(args.threads)], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        print(row(json.loads(out.stdout.strip().splitlines()[-1])), flush=True)
    print(load_average() + " at the end")


if __name__ == "__main__":
    main()
