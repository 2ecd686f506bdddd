"""What LocCa's tasks cost a training step: tiny-siglip2's forward and backward on one batch of the
shapes with regions (each row's regions and phrases as the loader gives them), three ways, side by
side in one process, taking turns each round:

- sigmoid: the sigmoid loss alone (no decoder);
- +caption: with the decoder's captions;
- LocCa: captions, referring expressions and grounded captions (half of each decoded in parallel);
- LocCa, chunked logits: the same with ``model.loss.caption_chunk`` 1024, which makes the logits of
  the labelled tokens only (the whole path makes them at every position of the padded rows).

Printed: the median seconds of a step over the rounds, and each against the sigmoid loss alone.

    PYTHONPATH=src python benchmarks/locca_step.py [--batch 64] [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from ema_demo import cpu_name  # benchmarks/ is on sys.path
from vltrain.compose.builders import build_model_for, build_tokenizer
from vltrain.config.job import load_config
from vltrain.data.dataset import build_dataset
from vltrain.data.loading.collate import Collator
from vltrain.data.tools.synth import synthesize, write_tokenizer
from vltrain.objectives.keyed import StepKey
from vltrain.objectives.scoring import Objectives

WAYS = {
    "sigmoid": ["model.loss.caption=0", "model.loss.referring=0", "model.loss.grounded_caption=0"],
    "+caption": ["model.loss.referring=0", "model.loss.grounded_caption=0"],
    "LocCa": [],
    "LocCa, chunked logits": ["model.loss.caption_chunk=1024"],
}


def setup(data: Path, batch: int, way: list[str]):
    cfg = load_config(None, [f"data.train={data / 'train.jsonl'}", f"data.tokenizer={data / 'tokenizer.json'}",
                             "data.image_size=48", "data.val=''", f"data.batch_size={batch}", "data.num_workers=0",
                             "model.preset=tiny-siglip2", "model.loss.itc=0", "model.loss.siglip=1",
                             "model.loss.caption=1", *way])
    tokenizer = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model_for(cfg, tokenizer)
    dataset = build_dataset(cfg.data, "train", tokenizer)
    batch = Collator.for_data(tokenizer.pad_id, cfg.data)([dataset[i] for i in range(batch)])
    inputs = batch.to_model_inputs("cpu", cfg.data.mean, cfg.data.std)
    return model, Objectives(cfg.model.loss, model.spec), replace(inputs, key=StepKey(0, 1))


def step(model, objectives, inputs) -> float:
    start = time.perf_counter()
    out = objectives.score(model, model.encode(inputs), inputs)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = Path(tempfile.mkdtemp(prefix="locca-step-"))
    synthesize(data, 2000, 10, text_only_fraction=0.2, seed=0, with_regions=True)
    write_tokenizer(data)
    ways = {name: setup(data, args.batch, o) for name, o in WAYS.items()}
    for parts in ways.values():
        step(*parts)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            times[name].append(step(*ways[name]))
    base = statistics.median(times["sigmoid"])
    regions = int(ways["LocCa"][2].images.box_mask.sum()) if ways["LocCa"][2].images.box_mask is not None else 0
    print(f"CPU: {cpu_name()}; batch {args.batch} ({regions} regions), {args.threads} thread(s), "
          f"median of {args.rounds} rounds")
    print("| objectives | s/step | against sigmoid alone |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.3f} | {statistics.median(t) / base:.2f}x |")


if __name__ == "__main__":
    main()
