"""What the captioning decoder costs: training samples/s with and without the caption loss, and
generation tokens/s with the key-value cache against recomputing every position.

Training: the trainer's own step code (``vltrain.demo.measure_rate``: forward, backward and the
optimizer, one warm-up step, then ``--steps`` timed) on random pairs of full caption length, for
the same towers with ``model.loss.caption`` 0 (no decoder) and 2 (OpenCLIP's CoCa weight):
tiny-coca at the demo's size (batch 128, 48 px, 32 tokens) and coca-vit-b32 (batch 8, 224 px,
76 tokens).

Generation: ``vltrain.model.generate`` on the same random model and images, greedy and beam 3,
cached and not; tokens/s counts the tokens the search produced per image (its best beam), so the
beams' extra work is the price of beam search. Random weights rarely end a caption early, so each
runs near ``--max-length``; the two ways give the same ids (checked here).

    PYTHONPATH=src python benchmarks/caption_cost.py [--steps 3] [--presets tiny-coca,coca-vit-b32]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from ema_demo import cpu_name  # benchmarks/ is on sys.path

from vltrain.config.job import load_config
from vltrain.demo import demo_config_path, measure_rate
from vltrain.model import build_model
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.model.generate import Decoding, generate
from vltrain.model.passes import direct

SIZES = {"tiny-coca": dict(batch=128, image=48, length=32, vocab=1000, images=32),
         "coca-vit-b32": dict(batch=8, image=224, length=76, vocab=49408, images=8)}


def train_rate(preset: str, caption: float, precision: str, steps: int) -> float:
    s = SIZES[preset]
    cfg = load_config(demo_config_path(), [f"model.preset={preset}", f"model.loss.caption={caption}",
                                           "model.loss.itm=0", f"data.batch_size={s['batch']}",
                                           f"data.image_size={s['image']}", f"data.max_text_length={s['length']}",
                                           f"train.precision={precision}"])
    return measure_rate(cfg, vocab=s["vocab"], steps=steps)


def generation(preset: str, precision: str, max_length: int) -> list[tuple[str, float, float, bool]]:
    s = SIZES[preset]
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, loss=LossConfig()), vocab_size=s["vocab"], pad_id=0, mask_id=4,
                        image_size=s["image"], max_text_length=s["length"]).eval()
    pixels = torch.randn(s["images"], 3, s["image"], s["image"])
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")
    rows = []
    for name, beam in (("greedy", 1), ("beam 3", 3)):
        out = {}
        for cache in (True, False):
            decoding = Decoding(max_length, beam=beam, cache=cache)
            with torch.no_grad(), autocast:
                tokens = model.image_tokens(pixels)
                start = time.perf_counter()
                ids = generate(direct(model), tokens, [2], 3, 0, decoding)
                seconds = time.perf_counter() - start
            out[cache] = (ids, sum(len(r) - 1 for r in ids) / seconds)
        rows.append((name, out[True][1], out[False][1], out[True][0] == out[False][0]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--presets", default="tiny-coca,coca-vit-b32")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--max-length", type=int, default=24, dest="max_length")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    presets = args.presets.split(",")
    print(f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.precision}\n")
    print("| preset | batch | samples/s, no caption | samples/s, caption 2 | ratio |")
    print("|---|---:|---:|---:|---:|")
    for preset in presets:
        plain = train_rate(preset, 0.0, args.precision, args.steps)
        caption = train_rate(preset, 2.0, args.precision, args.steps)
        print(f"| {preset} | {SIZES[preset]['batch']} | {plain:.1f} | {caption:.1f} | {caption / plain:.2f}x |",
              flush=True)
    print("\n| preset | search | images | tokens/s, cache | tokens/s, recomputed | speed-up | same ids |")
    print("|---|---|---:|---:|---:|---:|---|")
    for preset in presets:
        for name, cached, plain, same in generation(preset, args.precision, args.max_length):
            print(f"| {preset} | {name} | {SIZES[preset]['images']} | {cached:.0f} | {plain:.0f} | "
                  f"{cached / plain:.2f}x | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
