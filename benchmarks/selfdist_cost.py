"""What SigLIP 2's last stage costs a step: the views, the EMA teacher's pass and SILC, then TIPS.

Three Trainers of the same config in one process, differing only in ``train.stages``:

- sigmoid + LocCa: no stage (tiny-siglip2's own losses);
- + views, teacher, SILC: a stage from step 1 that turns the EMA teacher on with ``silc: 1.0``;
- + TIPS: the same with ``tips: 0.25`` as well (the recipe of ``benchmarks/selfdist_dense.py``).

Their steps alternate (one step of each per round, the first ``--warmup`` rounds untimed), so a
machine shared with other work slows each alike; each trainer's ``train_step`` is timed alone (the
loader's batch is drawn before the clock starts, ``data.num_workers=0``). Printed per configuration:
the median seconds of a step, wall and ``time.process_time`` (every thread of the process), and the
ratio to the first row's wall median. ``--image-size 96`` runs the same towers on 36 patches a
view instead of 9 (local views ``--local-size`` px).

    PYTHONPATH=src python benchmarks/selfdist_cost.py --data DIR [--batch 128] [--rounds 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ema_demo import cpu_name  # benchmarks/ is on sys.path

from vltrain.config.job import load_config
from vltrain.demo import demo_config_path
from vltrain.train.trainer import Trainer

CONFIGS = {
    "sigmoid + LocCa": [],
    "+ views, teacher, SILC": ["train.stages=[{at: 1, teacher: true, loss: {silc: 1.0}}]"],
    "+ TIPS": ["train.stages=[{at: 1, teacher: true, loss: {silc: 1.0, tips: 0.25}}]"],
}
BASE = ["model.preset=tiny-siglip2", "model.loss.itc=0", "model.loss.siglip=1", "model.loss.caption=1",
        "model.loss.parallel_prediction=0.5", "train.precision=fp32", "train.ema.decay=0.996",
        "model.selfdist.prototypes=512", "model.selfdist.hidden=256", "model.selfdist.bottleneck=64",
        "model.selfdist.local_views=4", "metrics.curves=false", "eval.every=0", "data.val=''", "eval.zeroshot=[]",
        "checkpoint.every=0", "data.num_workers=0", "data.persistent_workers=false", "train.log_every=1000"]


def build(data: Path, run_dir: Path, extra: list[str], args) -> Trainer:
    cfg = load_config(demo_config_path(), [
        *BASE, *extra, f"run.dir={run_dir}", f"data.train={data / 'train.jsonl'}",
        f"data.tokenizer={data / 'tokenizer.json'}", f"data.batch_size={args.batch}",
        f"data.image_size={args.image_size}", f"model.selfdist.local_size={args.local_size}",
        f"train.max_steps={args.rounds + args.warmup + 1}", f"train.threads={args.threads}"])
    return Trainer(cfg)


def one_step(trainer: Trainer) -> tuple[float, float]:
    """(wall, process) seconds of one train_step, the batch drawn before the clock starts."""
    trainer._enter_stage()
    micro, _ = trainer._next_micro_batches()
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train_step(micro)
    took = time.perf_counter() - wall, time.process_time() - cpu
    trainer.step += 1
    return took


def measure(data: Path, args) -> dict[str, list[tuple[float, float]]]:
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build(data, Path(tmp) / str(i), extra, args)
                    for i, (name, extra) in enumerate(CONFIGS.items())}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
        try:
            for r in range(args.warmup + args.rounds):
                for name, trainer in trainers.items():
                    took = one_step(trainer)
                    if r >= args.warmup:
                        times[name].append(took)
        finally:
            for trainer in trainers.values():
                trainer.close(False)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the shapes (vltrain data synth --regions)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=48)
    ap.add_argument("--local-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="train.threads (0: every core)")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps of each configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (the stage starts at step 1)")
    args = ap.parse_args()
    times = measure(args.data, args)
    base = statistics.median(w for w, _ in times["sigmoid + LocCa"])
    print(f"CPU: {cpu_name()}; fp32, {args.threads or 'all'} thread(s); tiny-siglip2 at {args.image_size} px, "
          f"batch {args.batch}, local views 4 x {args.local_size} px, prototypes 512; median of {args.rounds} "
          "alternating steps each")
    print("| configuration | s/step wall | s/step process | wall / baseline |")
    print("|---|---:|---:|---:|")
    for name, took in times.items():
        wall, cpu = statistics.median(w for w, _ in took), statistics.median(c for _, c in took)
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {wall / base:.2f}x |")


if __name__ == "__main__":
    main()
