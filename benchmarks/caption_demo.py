"""What a captioning decoder costs and gives on the demo: the same ``vltrain demo`` run (the shapes,
``configs/demo.yaml``, bf16 where the CPU has bf16 matrix instructions) at a pinned step count,
with and without the caption loss.

Variants (``--variants``, comma-separated):

- ``albef``: tiny-albef, ITC + ITM 0.25 (the demo config as it was);
- ``coca``: tiny-coca, ITC + caption (weight ``--caption``);
- ``coca-itm``: tiny-coca-itm, ITC + ITM 0.25 + caption;
- ``coca-nocap``: tiny-coca's towers (causal text) with the caption loss off: what the decoder's
  loss itself does to retrieval, the text tower being the same.

Printed per variant: training samples/s (the harmonic mean of the logged steps), the run's wall
time, held-out t2i / i2t R@1 on 1,000 pairs, and, where there is a decoder, BLEU-4 and CIDEr-D of
greedy captions of 200 held-out images (one reference each: the caption the generator wrote).

    PYTHONPATH=src python benchmarks/caption_demo.py [--steps 600] [--variants albef,coca,coca-itm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ema_demo import cpu_name  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "albef": ["model.preset=tiny-albef"],
    "coca": ["model.preset=tiny-coca", "model.loss.itm=0"],
    "coca-itm": ["model.preset=tiny-coca-itm"],
    "coca-nocap": ["model.preset=tiny-coca", "model.loss.itm=0", "model.loss.caption=0"],
}


def run(data: Path, run_dir: Path, steps: int, variant: str, caption: float, captions: Path) -> dict:
    extra = list(VARIANTS[variant])
    if "caption=0" not in " ".join(extra) and variant != "albef":
        extra += [f"model.loss.caption={caption}", f"eval.captions=[{{name: shapes, path: '{captions}'}}]"]
    cmd = [sys.executable, "-m", "vltrain", "demo", "--dir", str(run_dir), "--data", str(data),
           f"train.max_steps={steps}", "metrics.curves=false", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    final = json.loads((run_dir / "eval.json").read_text())[-1]
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in logged if "samples_per_s" in r and r.get("step", 0) > 20]
    return {"variant": variant, "samples_per_s": len(rates) / sum(1 / r for r in rates), "wall_s": wall,
            "t2i_r1": final["t2i_r1"], "i2t_r1": final["i2t_r1"],
            "bleu4": final.get("captions/shapes/bleu4"), "cider": final.get("captions/shapes/cider")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--variants", default="albef,coca,coca-itm")
    p.add_argument("--caption", type=float, default=1.0, help="model.loss.caption of the decoder variants")
    p.add_argument("--data", default="", help="the shapes (written there if absent; default: a temporary folder)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data or Path(tmp) / "shapes")
        sys.path.insert(0, str(REPO / "src"))
        from vltrain.demo import caption_set, prepare_data

        if not (data / "val.jsonl").exists():
            prepare_data(data)
        captions = caption_set(data)  # the demo's 200 held-out images
        for variant in args.variants.split(","):
            rows.append(run(data, Path(tmp) / variant, args.steps, variant, args.caption, captions))
            print(f"  {variant}: done in {rows[-1]['wall_s']:.0f} s", flush=True)
    print(f"\n{cpu_name()}, {os.cpu_count()} cores; {args.steps} steps of the demo config; caption weight "
          f"{args.caption}\n")
    print("| variant | samples/s | wall time | t2i R@1 | i2t R@1 | BLEU-4 | CIDEr-D |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cap = (f"{r['bleu4']:.3f} | {r['cider']:.3f}" if r["cider"] is not None else "- | -")
        print(f"| {r['variant']} | {r['samples_per_s']:.0f} | {r['wall_s']:.0f} s | {r['t2i_r1']:.3f} | "
              f"{r['i2t_r1']:.3f} | {cap} |")


if __name__ == "__main__":
    main()
