"""How often a small 2-rank run ends with a non-zero exit code (it should never).

Each run is a real ``torchrun --nproc-per-node 2 -m vltrain train`` on the shapes (tiny-clip,
32 x 32, 6 steps, a final evaluation and checkpoint), cycling through every combination of
fixed and budget batching, DDP and FSDP2, gradient caching off and on (2 micro-batches), and
blocking and asynchronous checkpoints. A run that aborts at exit (SIGABRT, ``terminate called
without an active exception``) or fails otherwise is counted, and its last lines are kept in
``--keep``. Printed: runs and non-zero exits per combination, and the exit codes seen.

    PYTHONPATH=src python benchmarks/exit_codes.py [--runs 320] [--jobs 2] [--keep DIR]

``--jobs 2`` runs two launches at once (four processes on two cores), which makes a race at
exit more likely to show, not less.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vltrain.data.tools.synth import synthesize
from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

from _net import free_port

AXES = {
    "batching": {"fixed": {}, "budget": {"data.batching": "budget"}},
    "parallelism": {"ddp": {}, "fsdp": {"train.parallelism": "fsdp"}},
    "gradcache": {"off": {}, "on": {"train.accumulation": 2, "train.contrastive_accumulation": "gradcache"}},
    "checkpoint": {"blocking": {}, "async": {"checkpoint.async_save": "true"}},
}
COMBOS = [dict(zip(AXES, names)) for names in itertools.product(*AXES.values())]


def make_data(root: Path) -> Path:
    synthesize(root, 128, 32, text_only_fraction=0.2, seed=0, image_size=32)
    train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=200)
    return root


def command(data: Path, run_dir: Path, combo: dict[str, str]) -> list[str]:
    settings = {
        "run.dir": run_dir, "data.train": data / "train.jsonl", "data.val": data / "val.jsonl",
        "data.tokenizer": data / "tokenizer.json", "data.image_size": 32, "data.max_text_length": 16,
        "data.num_workers": 0, "data.batch_size": 8, "model.preset": "tiny-clip", "train.max_steps": 6,
        "train.warmup_steps": 1, "train.precision": "fp32", "train.threads": 1, "train.progress": "false",
        "train.log_every": 2, "checkpoint.every": 3, "eval.batch_size": 32,
    }
    for axis, name in combo.items():
        settings.update(AXES[axis][name])
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "vltrain", "train", str(Path(__file__).parents[1] / "configs" / "demo.yaml"),
            *[f"{k}={v}" for k, v in settings.items()]]


def run_one(i: int, data: Path, scratch: Path, keep: Path | None) -> tuple[int, int]:
    combo = COMBOS[i % len(COMBOS)]
    run_dir = scratch / f"run-{i}"
    proc = subprocess.run(command(data, run_dir, combo), capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0 and keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"run-{i}.txt").write_text(f"{combo}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return i, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=320)
    ap.add_argument("--jobs", type=int, default=2, help="launches at once")
    ap.add_argument("--keep", type=Path, default=None, help="where the output of failed runs goes")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="vltrain-exits-"))
    data = make_data(scratch / "shapes")
    start = time.perf_counter()
    codes: dict[int, int] = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, code in pool.map(lambda i: run_one(i, data, scratch, args.keep), range(args.runs)):
            codes[i] = code
            if code != 0:
                print(f"run {i} {COMBOS[i % len(COMBOS)]}: exit {code}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)

    print(f"\n{args.runs} runs of 2 ranks in {(time.perf_counter() - start) / 60:.1f} min, {args.jobs} at a time\n")
    print("| batching | parallelism | gradcache | checkpoint | runs | non-zero exits |")
    print("|---|---|---|---|---:|---:|")
    for c, combo in enumerate(COMBOS):
        mine = [code for i, code in codes.items() if i % len(COMBOS) == c]
        print(f"| {' | '.join(combo.values())} | {len(mine)} | {sum(code != 0 for code in mine)} |")
    failed = sum(code != 0 for code in codes.values())
    print(f"| all | | | | {len(codes)} | {failed} |")
    print(f"\nexit codes: {dict(sorted(Counter(codes.values()).items()))}")


if __name__ == "__main__":
    main()
