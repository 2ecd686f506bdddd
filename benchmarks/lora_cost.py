"""LoRA against full fine-tuning of a ViT-B/16 CLIP on a CPU: what each trains, keeps and writes,
its peak memory and its speed, side by side in one invocation.

The ways (``--ways``, each run in a process of its own, interleaved: full, lora2, full, lora2, ...):
- ``full``: every weight trains (AdamW);
- ``lora2``: CLIP-LoRA's recipe, rank-2 adapters on q, k and v of every block of both towers
  (``train.lora.rank=2``, ``train.lora.targets=[q_proj,k_proj,v_proj]``);
- ``lora8``: rank 8 on q, k, v and out_proj (the default targets).

Each run is ``vltrain train`` on ``model.preset=clip-vit-b16`` (random weights), fp32, on shapes
images made by ``vltrain data synth`` at 224 px, captions read with OpenCLIP's tokenizer (49,408
tokens, the preset's own vocabulary; ``vltrain tokenizer from-openclip``, which needs open_clip's
vocabulary file installed; without it the shapes' 512-token tokenizer, and a smaller text
embedding), with one final checkpoint. Per run:
- **trainable parameters** and **optimizer state**: the elements and bytes of the optimizer's
  tensors in the final checkpoint (AdamW's ``exp_avg`` counts every trained parameter);
- **checkpoint per save**: the bytes of the checkpoint folder (``step-N``), and of it the tensor
  files (``*.distcp``); the rest is the run's config, state and a copy of the tokenizer.json;
  **base, once**: a LoRA run's ``lora-base.safetensors``, the frozen weights written once;
- **peak RSS**: the training process's peak resident set (``ru_maxrss``, from ``wait4``: its whole
  life, the final checkpoint included), and the run's own logged peak after its last step
  (``peak_memory_gb`` in ``metrics.jsonl``; the loader worker is a process apart in both);
- **samples/s**: the median of the per-step rates in ``metrics.jsonl`` after the first ``--warm``
  steps, over every repeat of the way;
- **wall**: the process from start to exit (imports, model build, the base file, steps, save).

    PYTHONPATH=src python benchmarks/lora_cost.py [--steps 6] [--warm 2] [--batch 8] [--repeats 2]
        [--ways full,lora2] [--threads 2] [--out /tmp/vltrain-lora-cost]

``--out`` is the work folder: the shapes data, the tokenizer, each run's folder and log, and
``results.json`` with every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAYS = {
    "full": [],
    "lora2": ["train.lora.rank=2", "train.lora.targets=[q_proj,k_proj,v_proj]"],
    "lora8": ["train.lora.rank=8", "train.lora.targets=[q_proj,k_proj,v_proj,out_proj]"],
}
"""A way's config overrides on top of the common ones."""
LABELS = {"full": "full fine-tuning", "lora2": "LoRA r=2, q,k,v", "lora8": "LoRA r=8, q,k,v,out"}
MiB, GiB = 2**20, 2**30


def vltrain(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-m", "vltrain", *argv], env=env, check=True, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def make_data(work: Path, rows: int) -> tuple[Path, Path, str]:
    """Shapes pairs at 224 px and a tokenizer (written once): (manifest, tokenizer.json, which)."""
    shapes = work / "shapes"
    if not (shapes / "train.jsonl").exists() or len((shapes / "train.jsonl").read_text().splitlines()) < rows:
        shutil.rmtree(shapes, ignore_errors=True)
        vltrain("data", "synth", "--out", str(shapes), "--num", str(rows), "--val", "0", "--image-size", "224")
    tokenizer = work / "openclip-tokenizer.json"
    if not tokenizer.exists():
        try:
            vltrain("tokenizer", "from-openclip", "--out", str(tokenizer))
        except subprocess.CalledProcessError as e:
            print(f"OpenCLIP's tokenizer not made ({e.stdout.strip().splitlines()[-1]}); the shapes' 512-token "
                  "tokenizer instead: the text embedding is smaller than ViT-B/16's", file=sys.stderr)
            return shapes / "train.jsonl", shapes / "tokenizer.json", "shapes BPE, 512 tokens"
    return shapes / "train.jsonl", tokenizer, "OpenCLIP's BPE, 49,408 tokens"


def run(work: Path, name: str, way: str, args, train: Path, tokenizer: Path) -> dict:
    """One ``vltrain train`` of ``way`` in a process of its own; its figures."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a run folder with a checkpoint would resume
    (work / "empty.yaml").write_text("{}\n")
    cmd = [sys.executable, "-m", "vltrain", "train", str(work / "empty.yaml"), f"run.dir={run_dir}",
           f"data.train={train}", "data.val=''", f"data.tokenizer={tokenizer}", "data.image_size=224",
           "data.max_text_length=77", f"data.batch_size={args.batch}", "data.num_workers=1",
           "model.preset=clip-vit-b16", f"train.max_steps={args.steps}", "train.warmup_steps=1",
           "train.precision=fp32", f"train.threads={args.threads}", "train.log_every=1", "train.progress=false",
           "eval.every=0", "checkpoint.every=0", "checkpoint.keep=0", "checkpoint.save_initial=never",
           "metrics.curves=false", *WAYS[way]]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    log = work / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{name} exited {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "samples_per_s" in r]
    return {"name": name, "way": way, "wall": wall, "peak_rss": usage.ru_maxrss * 1024,
            "logged_peak": rows[-1]["peak_memory_gb"] * GiB,
            "rates": [r["samples_per_s"] for r in rows if r["step"] > args.warm],
            **checkpoint_figures(run_dir / "checkpoints")}


def checkpoint_figures(folder: Path) -> dict:
    """What the final checkpoint holds: trained parameters and optimizer bytes (from its tensor
    index), the step folder's bytes and its tensor files', and a LoRA run's base file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step = folder / (folder / "latest").read_text().strip()
    index = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    optimizer = trained = model = 0
    for key, meta in index.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        numel = meta.size.numel()
        if key.startswith("optimizer.state."):
            optimizer += numel * meta.properties.dtype.itemsize
            trained += numel if key.endswith(".exp_avg") else 0
        elif key.startswith("model."):
            model += numel
    files = [p for p in step.rglob("*") if p.is_file()]
    base = folder / "lora-base.safetensors"
    return {"trained": trained, "model_tensors": model, "optimizer_bytes": optimizer,
            "checkpoint_bytes": sum(p.stat().st_size for p in files),
            "tensor_bytes": sum(p.stat().st_size for p in files if p.suffix == ".distcp"),
            "base_bytes": base.stat().st_size if base.exists() else 0}


def summary(runs: list[dict]) -> dict:
    """A way's figures over its repeats: sizes from the first (they do not vary), memory and wall
    as medians, samples/s as the median of every steady-state step of every repeat."""
    first = runs[0]
    return {**{k: first[k] for k in ("trained", "optimizer_bytes", "checkpoint_bytes", "tensor_bytes", "base_bytes")},
            "peak_rss": statistics.median(r["peak_rss"] for r in runs),
            "logged_peak": statistics.median(r["logged_peak"] for r in runs),
            "rate": statistics.median(x for r in runs for x in r["rates"]),
            "wall": statistics.median(r["wall"] for r in runs)}


def mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB" if n < 10 * MiB else f"{n / MiB:,.0f} MiB"


def print_tables(runs: list[dict], ways: list[str]) -> None:
    print("| run | peak RSS | logged peak | samples/s (steady steps) | wall |")
    print("|---|---:|---:|---|---:|")
    for r in runs:
        print(f"| {r['name']} | {r['peak_rss'] / GiB:.2f} GiB | {r['logged_peak'] / GiB:.2f} GiB | "
              f"{', '.join(f'{x:.3f}' for x in r['rates'])} | {r['wall']:.0f} s |")
    by_way = {w: summary([r for r in runs if r["way"] == w]) for w in ways}
    print("\n| way | trainable params | optimizer state | checkpoint per save (tensors) | base, once "
          "| peak RSS | logged peak | samples/s | wall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w, s in by_way.items():
        print(f"| {LABELS[w]} | {s['trained']:,} | {mib(s['optimizer_bytes'])} | {mib(s['checkpoint_bytes'])} "
              f"({mib(s['tensor_bytes'])}) | {mib(s['base_bytes']) if s['base_bytes'] else '-'} | "
              f"{s['peak_rss'] / GiB:.2f} GiB | {s['logged_peak'] / GiB:.2f} GiB | {s['rate']:.3f} | {s['wall']:.0f} s |")
    if "full" in by_way:
        f = by_way["full"]
        for w, s in by_way.items():
            if w == "full":
                continue
            print(f"| {w} / full | {s['trained'] / f['trained']:.5f}x | {s['optimizer_bytes'] / f['optimizer_bytes']:.5f}x "
                  f"| {s['checkpoint_bytes'] / f['checkpoint_bytes']:.4f}x ({s['tensor_bytes'] / f['tensor_bytes']:.5f}x) "
                  f"| - | {s['peak_rss'] / f['peak_rss']:.2f}x | {s['logged_peak'] / f['logged_peak']:.2f}x "
                  f"| {s['rate'] / f['rate']:.2f}x | {s['wall'] / f['wall']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=2, help="first steps left out of samples/s")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ways", default="full,lora2", help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/vltrain-lora-cost"), help="the work folder")
    args = ap.parse_args()
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        ap.error(f"--ways: {', '.join(unknown)}: choose from {', '.join(WAYS)}")
    if args.warm >= args.steps:
        ap.error(f"--warm {args.warm} leaves no step of {args.steps} to time")
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    train, tokenizer, which = make_data(work, max(64, args.batch * args.steps))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    import torch

    print(f"clip-vit-b16, fp32, batch {args.batch}, 224 px, {args.steps} steps (samples/s from step "
          f"{args.warm + 1}), {args.threads} threads, 1 loader worker, tokenizer: {which}; {cpu}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}; load average {os.getloadavg()[0]:.1f} at start\n",
          flush=True)
    runs = []
    for k in range(args.repeats):
        for way in ways:
            runs.append(run(work, f"{way}-{k}", way, args, train, tokenizer))
            print(f"  {way}-{k}: {runs[-1]['wall']:.0f} s, load average {os.getloadavg()[0]:.1f}", flush=True)
    (work / "results.json").write_text(json.dumps(runs, indent=1))
    full = next((r for r in runs if r["way"] == "full"), None)
    if full:
        print(f"\nthe model: {full['model_tensors']:,} parameters (the full run's checkpoint)\n")
    print_tables(runs, ways)


if __name__ == "__main__":
    main()
