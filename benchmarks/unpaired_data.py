"""Do unpaired rows help? The demo model at equal steps, on shapes data that is 10% image-text pairs,
45% text-only and 45% image-only rows, evaluated on 500 held-out pairs (retrieval R@1, R@5).

- (a) pairs only: the training rows that have both an image and a caption;
- (b) every row, with ``model.loss.text_mlm`` and ``model.loss.image_mim`` on (what the unpaired
  rows train);
- (c) as (b), with the pairs as a source of their own sampled 9x as often, so that about half of
  each batch is pairs (the per-source mixing of ``data.train``).

Each variant trains from seeds 0, 1, 2 (model and data order); the table gives the mean and the
spread (max - min) over seeds.

    PYTHONPATH=src python benchmarks/unpaired_data.py [--steps 600] [--seeds 0 1 2] [--workers 4] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vltrain.data.tools.synth import synthesize, write_tokenizer  # noqa: E402

UNIMODAL = ["model.loss.text_mlm=0.5", "model.loss.image_mim=0.5"]


def make_data(root: Path, rows: int, val: int) -> dict[str, Path]:
    paths = synthesize(root, rows, val, text_only_fraction=0.45, image_only_fraction=0.45, seed=0)
    lines = paths["train"].read_text().splitlines()
    paired = [json.loads(line).keys() >= {"image", "text"} for line in lines]
    (root / "pairs.jsonl").write_text("".join(f"{x}\n" for x, p in zip(lines, paired) if p))
    (root / "unpaired.jsonl").write_text("".join(f"{x}\n" for x, p in zip(lines, paired) if not p))
    # (c): the demo config with two sources, the pairs sampled 9x as often per row
    mixed = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    mixed["data"]["train"] = [{"path": str(root / "pairs.jsonl"), "weight": 9.0, "name": "pairs"},
                              {"path": str(root / "unpaired.jsonl"), "name": "unpaired"}]
    (root / "mixed.yaml").write_text(yaml.safe_dump(mixed))
    return {"train": paths["train"], "val": paths["val"], "pairs": root / "pairs.jsonl",
            "tokenizer": write_tokenizer(root), "mixed": root / "mixed.yaml", "count": sum(paired), "rows": len(lines)}


def variants(data: dict) -> dict[str, tuple[Path, list[str]]]:
    demo = REPO / "configs" / "demo.yaml"
    return {
        "(a) pairs only": (demo, [f"data.train={data['pairs']}"]),
        "(b) + unpaired rows, text_mlm + image_mim": (demo, [f"data.train={data['train']}", *UNIMODAL]),
        "(c) as (b), pairs sampled 9x": (data["mixed"], UNIMODAL),
    }


def run(config: Path, overrides: list[str], data: dict, run_dir: Path, seed: int, steps: int, workers: int,
        extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "vltrain", "train", str(config), f"run.dir={run_dir}", f"train.seed={seed}",
           f"train.max_steps={steps}", f"train.warmup_steps={steps // 10}", f"data.val={data['val']}",
           f"data.tokenizer={data['tokenizer']}", f"data.num_workers={workers}", "eval.every=0",
           "train.progress=false", *overrides, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    final = json.loads((run_dir / "eval.json").read_text())[-1]
    return {**final, "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rows", type=int, default=20000, help="training rows (10%% of them pairs)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("overrides", nargs="*", help="config overrides for every run (e.g. train.precision=fp32)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data(root / "data", args.rows, 500)
        print(f"{data['rows']:,} training rows, {data['count']:,} of them pairs; 500 held-out pairs; "
              f"{args.steps} steps of the demo config per run; seeds {args.seeds}", flush=True)
        results: dict[str, list[dict]] = {}
        for name, (config, overrides) in variants(data).items():
            for seed in args.seeds:
                r = run(config, overrides, data, root / f"run-{len(results)}-{seed}", seed, args.steps, args.workers,
                        args.overrides)
                results.setdefault(name, []).append(r)
                print(f"  {name} seed {seed}: t2i R@1 {r['t2i_r1']:.3f} R@5 {r['t2i_r5']:.3f}, "
                      f"i2t R@1 {r['i2t_r1']:.3f} R@5 {r['i2t_r5']:.3f} ({r['seconds']:.0f} s)", flush=True)
    print("\n| variant | t2i R@1 | t2i R@5 | i2t R@1 | i2t R@5 |")
    print("|---|---:|---:|---:|---:|")
    for name, rs in results.items():
        cells = []
        for key in ("t2i_r1", "t2i_r5", "i2t_r1", "i2t_r5"):
            values = [r[key] for r in rs]
            cells.append(f"{statistics.mean(values):.3f} (spread {max(values) - min(values):.3f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
