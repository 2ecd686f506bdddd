"""Training-step throughput under patch dropout (``model.vision.patch_dropout``): samples/s at
dropout 0, 0.5 and 0.75, and the ratio to dropout 0.

Per preset (clip-vit-b32 and clip-vit-b16, both at 224 px), one model and one optimizer take every
arm: fp32 and bf16 autocast, square images (224 x 224) and images at their own shape padded to
``data.max_patches`` (``data.resize: native``, as many patches as the square), each at the three
dropouts. A step is the trainer's own :class:`vltrain.train.step.Step` (its key, so that
``Objectives.patch_keep`` draws the kept patches; forward and backward of both towers and the
contrastive loss; clipping; the AdamW update) on one micro-batch of image-text pairs: images of
aspect ratios 1:3 to 3:1 decoded and collated by the loader's own code (``native_shape.decoded_batch``),
random captions of full length; and the same native images packed several to a sequence
(``data.pack_images``), whose sequences keep only the kept patches (``vltrain.pixels.drop_packed``).

The arms alternate within each round (forward order, then reversed), after one untimed step each,
so that other load on the machine falls on all of them; each round times ``--steps`` steps per arm
(their median), and the table gives the median over rounds of samples/s and of the per-round ratio
to dropout 0 of the same precision and images. Beside it, the fastest round of each arm over the
fastest at dropout 0: other load only ever slows a step, so on a shared machine the best rounds are
the steadier estimate where the rounds' range is wide.

Beside each measured ratio, what the FLOPs predict: the vision tower alone (``VisionTower.flops``:
every patch is embedded, the blocks see the kept ones) and the whole model
(``VLModel.flops_per_sample``: the text tower, which patch dropout does not touch, included). The
measured step also holds what FLOPs leave out: the AdamW update over every parameter, the loss,
and the elementwise work.

    PYTHONPATH=src python benchmarks/patch_dropout_speed.py [--quick] [--batch 8] [--steps 1]
        [--rounds 7] [--presets clip-vit-b32,clip-vit-b16] [--precisions fp32,bf16] [--device cuda]

On a GPU (``--device cuda``) each step is timed to its last kernel (synchronized).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _demo_model import load_average, sync
from native_shape import decoded_batch, mixed_images

from vltrain.config.job import load_config
from vltrain.model import build_model
from vltrain.model.presets import PRESETS
from vltrain.runtime.distributed import World
from vltrain.runtime.precision import BF16_CPU_FLAGS, Precision, cpu_has_bf16_matmul
from vltrain.runtime.world import keep_freed_memory
from vltrain.compose.builders import build_task
from vltrain.compose.rules import fit_native
from vltrain.train.optim import build_optimizer, build_scheduler
from vltrain.train.parallelize import parallelize
from vltrain.train.step import Step

DROPOUTS = (0.0, 0.5, 0.75)
LAYOUTS = {"square": ("crop", False), "native padded": ("native", False), "native packed": ("native", True)}
"""Each arm's images: (data.resize, data.pack_images)."""
"""The table's name for each image layout, and its ``data.resize``."""
IMAGE_SIZE = 224


def cpu_line() -> str:
    """The CPU's model name and which bf16 matrix instructions it has."""
    name, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    have = [f for f in BF16_CPU_FLAGS if f in flags]
    bf16 = f"bf16 native ({', '.join(have)})" if have else "bf16 emulated (neither AVX512_BF16 nor AMX)"
    return f"CPU: {name}, {os.cpu_count()} cores; {bf16}"


def arm_config(preset: str, resize: str, precision: str, dropout: float, pack: bool = False):
    """The job config of one arm: the preset at 224 px, max_patches the square's patch count."""
    side = IMAGE_SIZE // PRESETS[preset]().vision.patch_size
    cfg = load_config(None, [f"model.preset={preset}", f"data.image_size={IMAGE_SIZE}", f"data.resize={resize}",
                             f"data.max_patches={side * side}", f"data.pack_images={str(pack).lower()}",
                             f"train.precision={precision}", f"model.vision.patch_dropout={dropout}",
                             "train.max_steps=100000"])
    fit_native(cfg)
    return cfg


class Arms:
    """One preset's model and optimizer, and a Step per (precision, dropout) sharing them."""

    def __init__(self, preset: str, precisions: list[str], batch: int, device: torch.device):
        cfg = arm_config(preset, "crop", "fp32", 0.0)
        torch.manual_seed(0)
        self.device = device
        self.model = build_model(cfg.model, vocab_size=512, pad_id=0, mask_id=4, image_size=IMAGE_SIZE,
                                 max_text_length=cfg.data.max_text_length).to(device)
        self.text_length = cfg.data.max_text_length
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer = build_optimizer(self.model, cfg.train)
        scheduler = build_scheduler(optimizer, cfg.train)
        world = World(0, 1, 0, device)
        images = mixed_images(batch)
        self.inputs = {}
        for layout, (resize, pack) in LAYOUTS.items():
            c = arm_config(preset, resize, "fp32", 0.0, pack)
            collated, _ = decoded_batch(c, images, self.text_length)
            self.inputs[layout] = collated.to_model_inputs(device, c.data.mean, c.data.std)
        self.steps: dict[tuple[str, float], Step] = {}
        for precision in precisions:
            for dropout in DROPOUTS:
                c = arm_config(preset, "crop", precision, dropout)
                task = build_task(c, self.model)
                p = Precision(precision, device)
                self.steps[precision, dropout] = Step(parallelize(task, c.train, device), task.objectives,
                                                      params, optimizer, scheduler, p.grad_scaler(), p, c.train, world)
        self.done = 0

    def run(self, precision: str, layout: str, dropout: float) -> float:
        """Seconds of one training step of this arm."""
        sync(self.device)
        start = time.perf_counter()
        self.steps[precision, dropout]([self.inputs[layout]], self.done)
        sync(self.device)
        self.done += 1
        return time.perf_counter() - start

    def update_seconds(self, repeats: int = 3) -> float:
        """The AdamW update alone (on the last step's gradients): a cost per step that no dropout cuts."""
        times = []
        for _ in range(repeats):
            sync(self.device)
            start = time.perf_counter()
            self.optimizer.step()
            sync(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def kept(self, dropout: float) -> int:
        """The patch positions the blocks see (square: of the grid; native: of max_patches)."""
        precision = next(iter(self.steps))[0]
        objectives = self.steps[precision, dropout].objectives
        return objectives.kept_patch_count(0) or objectives.spec.num_patches

    def flop_ratios(self, dropout: float) -> tuple[float, float]:
        """Dropout 0's FLOPs over this dropout's: the vision tower alone, and the whole model."""
        k = self.kept(dropout)
        vision = self.model.vision.flops() / self.model.vision.flops(k)
        model = self.model.flops_per_sample(self.text_length) / self.model.flops_per_sample(self.text_length, k)
        return vision, model


def measure(arms: Arms, names: list[tuple[str, str, float]], steps: dict[str, int], rounds: int, batch: int
            ) -> dict[tuple[str, str, float], dict]:
    """Per arm: samples/s per round (median of its steps in that round), arms alternating."""
    for name in names:  # warm-up: allocation and the kernels of each shape
        arms.run(*name)
    rates: dict[tuple, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times = [arms.run(*name) for _ in range(steps[name[0]])]
            rates[name].append(batch / statistics.median(times))
    out = {}
    for precision, layout, dropout in names:
        mine, base = rates[precision, layout, dropout], rates[precision, layout, 0.0]
        ratios = [a / b for a, b in zip(mine, base)]
        out[precision, layout, dropout] = {"sps": statistics.median(mine), "ratio": statistics.median(ratios),
                                           "low": min(ratios), "high": max(ratios), "best": max(mine) / max(base)}
    return out


def table(preset: str, args: argparse.Namespace, steps: dict[str, int]) -> None:
    start = time.perf_counter()
    arms = Arms(preset, args.precisions, args.batch, torch.device(args.device))
    names = [(p, layout, d) for p in args.precisions for layout in LAYOUTS for d in DROPOUTS]
    results = measure(arms, names, steps, args.rounds, args.batch)
    m = arms.model
    vision, text = m.vision.flops(), m.text.flops(arms.text_length)
    n = arms.kept(0.0)
    update = arms.update_seconds()
    base = args.batch / results[args.precisions[0], "square", 0.0]["sps"]
    grids = arms.inputs["native padded"].images.grids
    real = float(grids.prod(dim=1).sum()) / (len(grids) * n)
    sequences = arms.inputs["native packed"].images.pixels.shape[0]
    print(f"\n{preset}: {n} patches of {m.vision.cfg.patch_size} px at 224 px; native padded images fill {real:.0%} of "
          f"their {n} positions; packed, the {len(grids)} images take {sequences} sequences. Forward FLOPs per sample at dropout 0: vision {vision / 1e9:.2f} G, "
          f"text {text / 1e9:.2f} G ({arms.text_length} tokens), text share {text / (vision + text):.0%}. "
          f"The AdamW update alone: {update * 1e3:.0f} ms, {update / base:.0%} of a {args.precisions[0]} square "
          f"step at dropout 0. {time.perf_counter() - start:.0f} s; {load_average()}")
    print("| precision | images | dropout | patches kept | samples/s | vs dropout 0 | range over rounds "
          "| best round vs best at 0 | FLOP ratio: vision tower | FLOP ratio: model |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for precision in args.precisions:
        for layout in LAYOUTS:
            for d in DROPOUTS:
                r = results[precision, layout, d]
                fv, fm = arms.flop_ratios(d)
                print(f"| {precision} | {layout} | {d:g} | {arms.kept(d)} of {n} | {r['sps']:.2f} | {r['ratio']:.2f}x "
                      f"| {r['low']:.2f} to {r['high']:.2f} | {r['best']:.2f}x | {fv:.2f}x | {fm:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: clip-vit-b32 only, 2 rounds")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1, help="timed steps per arm per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--presets", default="clip-vit-b32,clip-vit-b16")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU")
    args = p.parse_args()
    if args.quick:
        args.presets, args.rounds = "clip-vit-b32", 2
    args.precisions = args.precisions.split(",")
    keep_freed_memory()
    torch.set_num_threads(os.cpu_count() or 1)
    native_bf16 = args.device != "cpu" or cpu_has_bf16_matmul()
    steps = {precision: args.steps for precision in args.precisions}
    print(cpu_line() if args.device == "cpu" else f"GPU: {torch.cuda.get_device_name(0)}; host {cpu_line()}")
    print(f"batch {args.batch} image-text pairs, {torch.get_num_threads()} threads, {args.rounds} rounds of "
          f"{args.steps} timed steps per arm (after one untimed), a step = forward + backward + AdamW "
          f"(vltrain.train.step.Step); torch {torch.__version__}")
    if "bf16" in steps and not native_bf16:
        steps["bf16"] = 1
        print("bf16 is emulated on this CPU, about 30x slower than fp32: its arms take 1 timed step per round "
              "(--precisions fp32 leaves them out)")
    for preset in args.presets.split(","):
        table(preset, args, steps)


if __name__ == "__main__":
    main()
