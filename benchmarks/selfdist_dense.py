"""SigLIP 2's claim on the shapes: does SILC + TIPS in the last 20% of training improve the dense
features (and keep retrieval), at equal steps?

tiny-siglip2 (a MAP-pooled ViT, the sigmoid loss and a one-layer LocCa decoder) trained by
``vltrain demo`` in fp32 on ``vltrain data synth --regions --masks`` shapes, two arms per seed
(``train.seed`` 0 and 1), differing only in the last stage:

- sigmoid + LocCa: SigLIP 2's first stage throughout (LocCa half parallel, as ``locca_demo.py``);
- + SILC/TIPS: from 0.8 of the run, ``train.stages`` ``{at: 0.8, teacher: true, loss: {silc: 1.0,
  tips: 0.25}}`` with an EMA teacher (``train.ema.decay`` ``--decay``) and heads sized for the tiny
  model (``SELFDIST``: 512 prototypes, hidden 256, bottleneck 64, 4 local views of half the image).

``--image-size`` and ``--patch`` set the images' side and the tower's patch (the preset has 16 on 48;
another patch gives ``model.arch``, the preset's architecture with that patch, at the tokenizer's
vocabulary). The dense probe labels each patch with the majority class of its pixels, so the grid
must be finer than the shapes: on the preset's 3 x 3 grid 96% of the labels are background and
any features separate the rest (mIoU 1.000 at step 40). 64-px images in 8-px patches (8 x 8, the
default) give every class, and a tower 20 steps from its start scores mIoU 0.43. Without ``--data``
the shapes are written first, at ``--image-size``.

Printed per run: the dense linear probe's mIoU on the held-out masks (``eval.dense``, the student's
weights), held-out t2i / i2t R@1 on 1,000 pairs, zero-shot top-1 on the 6 shape kinds, and the
median seconds of a step before and after step 0.8 x steps (the logged windows, the first dropped);
for the staged arm also the EMA teacher's mIoU.

    PYTHONPATH=src python benchmarks/selfdist_dense.py [--steps 800] [--batch 64] [--decay 0.98] \
        [--image-size 64] [--patch 8] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from distill_demo import vltrain  # benchmarks/ is on sys.path
from ema_demo import cpu_name

BASE = ["model.loss.itc=0", "model.loss.siglip=1", "model.loss.caption=1",
        "model.loss.parallel_prediction=0.5", "train.precision=fp32", "metrics.curves=false",
        "eval.captions=[]", "eval.referring=[]", "train.log_every=10", "train.threads=1"]
SELFDIST = ["model.selfdist.prototypes=512", "model.selfdist.hidden=256", "model.selfdist.bottleneck=64",
            "model.selfdist.local_views=4",
            "train.stages=[{at: 0.8, teacher: true, loss: {silc: 1.0, tips: 0.25}}]"]
ARMS = ("sigmoid + LocCa", "+ SILC/TIPS")


def seconds_per_step(run_dir: Path, batch: int, boundary: int) -> tuple[float, float]:
    """Median seconds of a step in the logged windows up to ``boundary`` (the first dropped) and after."""
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "samples_per_s" in r]
    before = [batch / r["samples_per_s"] for r in rows if r["step"] <= boundary][1:]
    after = [batch / r["samples_per_s"] for r in rows if r["step"] > boundary]
    return statistics.median(before), statistics.median(after)


def model_settings(args) -> list[str]:
    """The preset at its own patch, else ``model.arch``: tiny-siglip2 with ``--patch``, sized for the data."""
    settings = [f"data.image_size={args.image_size}", f"model.selfdist.local_size={args.image_size // 2}"]
    if args.patch == 16:
        return settings + ["model.preset=tiny-siglip2"]
    from vltrain.data.tokenizers import load_tokenizer
    from vltrain.model.presets import tiny_siglip2

    arch = tiny_siglip2().to_dict()
    arch["vision"].update(patch_size=args.patch, image_size=args.image_size)
    arch["text"].update(vocab_size=load_tokenizer(str(args.data / "tokenizer.json")).vocab_size,
                        max_length=32)  # the demo's data.max_text_length
    return settings + ["model.preset=", "model.arch=" + yaml.safe_dump(arch, default_flow_style=True, width=10**6).strip()]


def run(args, arm: str, seed: int) -> dict:
    run_dir = args.root / f"{'staged' if arm != ARMS[0] else 'base'}-{seed}"
    dense = args.data / "dense.jsonl"
    extra = SELFDIST + [f"train.ema.decay={args.decay}"] if arm != ARMS[0] else []
    _, took = vltrain("demo", "--dir", run_dir, "--data", args.data, *BASE, *model_settings(args), *extra,
                      f"train.seed={seed}", f"train.max_steps={args.steps}", f"eval.every={args.steps}",
                      f"data.batch_size={args.batch}", f"eval.dense=[{{name: shapes, path: '{dense}'}}]")
    m = json.loads((run_dir / "eval.json").read_text())[-1]
    before, after = seconds_per_step(run_dir, args.batch, int(round(0.8 * args.steps)))
    teacher = next((v for k, v in m.items() if "ema" in k and k.endswith("dense/shapes/miou")), None)
    print(f"{arm} seed {seed}: {took:.0f} s", flush=True)
    return {"arm": arm, "seed": seed, "metrics": m, "before": before, "after": after, "wall": took, "teacher": teacher}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--decay", type=float, default=0.98, help="train.ema.decay of the staged arm")
    ap.add_argument("--image-size", type=int, default=64, help="the shapes' side, and data.image_size")
    ap.add_argument("--patch", type=int, default=8, help="the vision tower's patch (16: the preset itself)")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--data", type=Path, help="shapes written by vltrain data synth --regions --masks (default: "
                    "written here)")
    args = ap.parse_args()
    args.root = Path(tempfile.mkdtemp(prefix="selfdist-dense-"))
    if args.data is None:
        args.data = args.root / "shapes"
        vltrain("data", "synth", "--out", args.data, "--num", "20000", "--val", "1000", "--text-only-fraction", "0.2",
                "--regions", "--masks", "--image-size", args.image_size)
    rows = [run(args, arm, seed) for seed in args.seeds for arm in ARMS]
    (args.root / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"CPU: {cpu_name()}; fp32; tiny-siglip2, {args.patch}-px patches on {args.image_size} px, {args.steps} steps of {args.batch}; stage from step "
          f"{int(round(0.8 * args.steps)) + 1}; results in {args.root / 'results.json'}")
    print("| arm | seed | mIoU | t2i R@1 | i2t R@1 | zero-shot top-1 | s/step before | s/step after | teacher mIoU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m, t = r["metrics"], r["teacher"]
        print(f"| {r['arm']} | {r['seed']} | {m['dense/shapes/miou']:.3f} | {m['t2i_r1']:.3f} | {m['i2t_r1']:.3f} | "
              f"{m['zeroshot/shapes/top1']:.3f} | {r['before']:.2f} | {r['after']:.2f} | "
              f"{'-' if t is None else f'{t:.3f}'} |")


if __name__ == "__main__":
    main()
