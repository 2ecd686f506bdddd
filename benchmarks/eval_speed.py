"""Zero-shot evaluation speed against the training step, on the demo model.

Zero-shot images/s: one whole ``evaluate_zeroshot`` (prompts encoded once, images decoded by the
evaluation loader with the config's workers, embedded without autograd under the training's
autocast, the per-class counts reduced) over a class-per-folder shapes set, after one warm-up
evaluation. Training samples/s: the trainer's own step code (forward + backward + AdamW) on random
pairs of full caption length (``vltrain.demo.measure_rate``). Both at the same precision and threads.

Target: zero-shot images/s >= 2.5x training samples/s.

    PYTHONPATH=src python benchmarks/eval_speed.py [--per-class 200] [--threads 2] [--repeats 3]
        [--batch 128] [--precisions fp32,bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from _demo_model import demo_config, load_average

from vltrain.data.tokenizers import load_tokenizer
from vltrain.data.tools.synth import synthesize, synthesize_classify, write_tokenizer
from vltrain.demo import measure_rate
from vltrain.eval.embedding import Encoder
from vltrain.eval.zeroshot import evaluate_zeroshot, open_zeroshot
from vltrain.runtime.precision import Precision
from vltrain.compose.builders import build_model_for, build_task


def zeroshot_rate(cfg, root: Path, tokenizer, repeats: int) -> tuple[float, int]:
    """(images/s of one whole zero-shot evaluation, images) at ``cfg``'s precision."""
    model = build_model_for(cfg, tokenizer)
    task = build_task(cfg, model)
    zs = open_zeroshot("shapes", str(root), str(root / "templates.txt"), cfg.data, tokenizer, rank=0,
                       world_size=1, batch_size=cfg.eval.batch_size)
    autocast = Precision(cfg.train.precision, torch.device("cpu")).autocast
    evaluate_zeroshot(Encoder(task, cfg.data, torch.device("cpu"), autocast), zs)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        m = evaluate_zeroshot(Encoder(task, cfg.data, torch.device("cpu"), autocast), zs)
        best = min(best, time.perf_counter() - start)
    n = int(m["zeroshot/shapes/num_images"])
    return n / best, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-class", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="training batch (the demo's by default)")
    ap.add_argument("--precisions", default="fp32,bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        synthesize(data, 500, 0, seed=0, workers=1)
        tokenizer = load_tokenizer(str(write_tokenizer(data)))
        synthesize_classify(data / "classify", args.per_class, workers=1)
        print(f"load average before: {load_average()}")
        print("| precision | training samples/s | zero-shot images/s | ratio | images | prompts |")
        print("|---|---:|---:|---:|---:|---:|")
        for precision in args.precisions.split(","):
            cfg = demo_config(f"train.precision={precision}", f"train.threads={args.threads}",
                              f"data.tokenizer={data / 'tokenizer.json'}", f"data.batch_size={args.batch}")
            train = measure_rate(cfg, steps=3)
            rate, n = zeroshot_rate(cfg, data / "classify", tokenizer, args.repeats)
            prompts = 6 * len((data / "classify" / "templates.txt").read_text().split("\n")[:-1])
            print(f"| {precision} | {train:.0f} | {rate:.0f} | {rate / train:.1f}x | {n} | {prompts} |", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
