"""Data at scale: building the sample index, the first batch, memory per node, loader throughput.

For each ``--rows`` N and ``--kinds`` (a JSONL manifest; tar shards, 1,000 samples a shard up to 1M
rows and 10,000 above; Hub-style parquet, 100,000 rows a file in row groups of 1,000), it writes the data once under ``--workdir`` (``_data_scale_data.py``: 32
small images, 48 px shapes from ``vltrain.data.tools.synth``, PNG and JPEG, reused cyclically; captions
from ``synth.describe``; a unique id per row: the manifest's ``id``, the shard member's key), then:

  build:  deletes the data's sample index and times ``open_indexed`` building it with one process
          per core from a cold page cache (rows/s of wall time; rows per CPU-second of the build's
          processes, i.e. per core whatever else the machine runs; ``--build-repeats`` builds, the
          median shown, and each build's rate); then, once, up to ``--tokens-max``
          rows, the caption token counts (``source.text_len()``, made on first use: only budget
          batching needs them). For shards, the rate at which the same files read back
          sequentially from a cold page cache (the disk), and the rate of walking their tar
          headers in plain Python (``tar_walk``: a floor for what a scan costs).
  first:  spawns 2 rank processes (RANK/WORLD_SIZE/LOCAL_RANK), each doing ``build_dataset`` +
          ``build_train_loader`` (batch 256, 2 loader workers) + ``next(loader)``, timed from
          before ``build_dataset`` to the first batch; with the windowed shuffle
          (``shuffle_window=16``), the full permutation (0), and up to ``--eager-max`` rows the
          old eager path (``ManifestSource`` / ``ShardSource`` opened directly, full permutation).
          Once both ranks hold their first batch, the memory of every rank and loader worker is
          read (psutil ``memory_full_info``): a rank's USS and PSS, and the node's PSS summed over
          ranks and workers (PSS splits a shared page between the processes that map it, so the
          index's memory map and copy-on-write pages are counted once). Growth is that minus the
          same run over a 2,000-row data set of the same kind; bytes per sample = growth / rows.
  loader: on the 100k-row data (100 shards), samples/s of the training loader (batch 256, 2
          workers, wall time over ``--batches`` batches after the first, the prefetched ones
          drained first), old eager path against the index with the full permutation and with
          the windowed shuffle; each setting ``--repeats`` times, interleaved; best rate and the
          median of each pass's ratio to the eager pass next to it.

and prints markdown tables, the mixing of the windowed shuffle (shards per batch), and an
extrapolation to 1B rows (index size, build time on 64 cores, memory per node, first batch).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/data_scale.py --rows 100000 1000000 10000000 --kinds jsonl shards

``--build-only`` prints the build table alone (the index build, nothing after it)::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/data_scale.py --build-only --build-repeats 5 \
        --rows 1000000 --kinds jsonl shards --tokens-max 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from _data_scale_data import dataset, disk_read_rate, drop_cache, make_assets, shards_per, tar_walk, tar_walk_rate  # noqa: E402

from vltrain.data.config import DataConfig  # noqa: E402
from vltrain.data.dataset import ImageTextDataset, build_dataset  # noqa: E402
from vltrain.data.index.open import open_indexed  # noqa: E402
from vltrain.data.index.reader import BYTES_PER_SAMPLE  # noqa: E402
from vltrain.data.loading.loader import build_train_loader  # noqa: E402
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule  # noqa: E402
from vltrain.data.sources.manifests import ManifestSource  # noqa: E402
from vltrain.data.sources.shards import ShardSource, shard_paths, span_members  # noqa: E402
from vltrain.data.tokenizers import load_tokenizer  # noqa: E402
from vltrain.data.tools.tokenizer_training import train_tokenizer  # noqa: E402

TINY = 2000
WORLD, LOADER_WORKERS, BATCH, WINDOW = 2, 2, 256, 16
TARGET_ROWS = 1_000_000_000
SETTLE_S = 3.0


def data_files(spec: str) -> list[str]:
    return shard_paths(spec) if spec.endswith((".tar", ".parquet")) else [spec]


def tokenizer_path(work: Path, captions: list[list[str]]) -> str:
    path = work / "tokenizer.json"
    if not path.is_file():
        train_tokenizer((c for cs in captions for c in cs), path, vocab_size=512)
    return str(path)


# -- index build -----------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the build's process pool)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def time_build(spec: str, tok_path: str, workers: int, tokens: bool) -> dict:
    """The index built from nothing (cold page cache), then, if ``tokens``, its caption token counts."""
    files = data_files(spec)
    shutil.rmtree(Path(files[0]).parent / ".vltrain-index", ignore_errors=True)
    drop_cache(files)
    tokenizer = load_tokenizer(tok_path)
    wall, cpu = time.monotonic(), cpu_seconds()
    source = open_indexed(spec, tokenizer, 77, workers=workers)
    out = {"rows": len(source), "wall_s": time.monotonic() - wall, "cpu_s": cpu_seconds() - cpu,
           "data_bytes": sum(os.path.getsize(f) for f in files)}
    if tokens:
        wall, cpu = time.monotonic(), cpu_seconds()
        source.text_len()
        out.update(tokens_wall_s=time.monotonic() - wall, tokens_cpu_s=cpu_seconds() - cpu)
    out["index_bytes"] = sum(p.stat().st_size for p in source.index_dir.iterdir())
    return out


# -- first batch and memory (rank processes) -------------------------------------------------------


def data_config(spec: str, tok_path: str, window: int, workers: int = LOADER_WORKERS) -> DataConfig:
    return DataConfig(train=spec, tokenizer=tok_path, batch_size=BATCH, image_size=48, num_workers=workers,
                      shuffle_window=window, pin_memory=False)


def eager_dataset(cfg: DataConfig, tokenizer) -> ImageTextDataset:
    """Today's path before the index: every row parsed into Python lists by every rank."""
    spec = str(cfg.train)
    source = ShardSource(spec) if spec.endswith(".tar") else ManifestSource(spec)
    return ImageTextDataset([source], tokenizer, cfg, plan_aware=True)


def open_loader(spec: str, tok_path: str, mode: str, rank: int, world: int, tokenizer=None):
    """(dataset, loader) of ``mode``: "window" (index, shuffle_window 16), "full" (index, full
    permutation) or "eager" (ManifestSource / ShardSource, full permutation)."""
    tokenizer = tokenizer or load_tokenizer(tok_path)
    cfg = data_config(spec, tok_path, WINDOW if mode == "window" else 0)
    ds = eager_dataset(cfg, tokenizer) if mode == "eager" else build_dataset(cfg, "train", tokenizer,
                                                                                   plan_aware=True)
    loader = build_train_loader(cfg, ds, rank=rank, world_size=world, seed=0, run_dir=None, pad_id=tokenizer.pad_id)
    return ds, loader


def rank_main(job: dict) -> None:
    """One rank: open the data, take the first batch, report, wait for the memory reading."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tokenizer = load_tokenizer(job["tokenizer"])
    started = time.perf_counter()
    ds, loader = open_loader(job["spec"], job["tokenizer"], job["mode"], rank, world, tokenizer)
    opened = time.perf_counter() - started
    batch = next(loader)
    took = time.perf_counter() - started
    time.sleep(SETTLE_S)  # the workers finish prefetching: memory is read in a steady state
    rebuilt = any(getattr(s, "built_now", False) for s in ds.sources)  # the index should be there already
    print(json.dumps({"rank": rank, "open_s": opened, "first_s": took, "rows": len(batch), "rebuilt": rebuilt}),
          flush=True)
    sys.stdin.readline()
    loader.close()


def memory(pids: list[int]) -> tuple[list[dict], int]:
    """Per rank: its own USS/PSS and its workers' PSS; and the PSS of all of them together."""
    ranks, total = [], 0
    for pid in pids:
        p = psutil.Process(pid)
        own = p.memory_full_info()
        workers = sum(c.memory_full_info().pss for c in p.children(recursive=True))
        ranks.append({"uss": own.uss, "pss": own.pss, "workers_pss": workers})
        total += own.pss + workers
    return ranks, total


def run_ranks(spec: str, tok_path: str, mode: str) -> dict:
    job = json.dumps({"spec": spec, "tokenizer": tok_path, "mode": mode})
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-job", job], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    try:
        reports = [json.loads(p.stdout.readline()) for p in procs]
        ranks, total = memory([p.pid for p in procs])
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=120)
    if any(r["rebuilt"] for r in reports):
        raise RuntimeError(f"{spec}: a rank built the index again (did the code change under the benchmark?)")
    return {"first_s": [r["first_s"] for r in reports], "open_s": [r["open_s"] for r in reports],
            "ranks": ranks, "node_pss": total}


# -- loader throughput -----------------------------------------------------------------------------


def throughput(loader, batches: int) -> float:
    for _ in range(LOADER_WORKERS * 2):  # what the workers prefetched while the others were timed
        next(loader)
    started = time.perf_counter()
    n = sum(len(next(loader)) for _ in range(batches))
    return n / (time.perf_counter() - started)


def loader_table(specs: dict[str, str], tok_path: str, batches: int, repeats: int) -> list[tuple]:
    loaders = {}
    for kind, spec in specs.items():
        for mode in ("eager", "full", "window"):
            loaders[kind, mode] = open_loader(spec, tok_path, mode, 0, 1)[1]
            next(loaders[kind, mode])
    rates: dict = {k: [] for k in loaders}
    for _ in range(repeats):
        for key, loader in loaders.items():
            rates[key].append(throughput(loader, batches))
    for loader in loaders.values():
        loader.close()
    out = []
    for (kind, mode), r in rates.items():
        base = rates[kind, "eager"]
        ratios = [a / b for a, b in zip(r, base)]
        out.append((kind, mode, max(r), max(r) / max(base), statistics.median(ratios)))
    return out


def read_costs(spec: str, tok_path: str, count: int = 5000, repeats: int = 3) -> list[tuple[str, float]]:
    """CPU microseconds per sample of what a loader worker does before decoding: ``row(i)`` and
    ``read_image(i)`` of random rows, eager source against indexed source (one process)."""
    eager = ShardSource(spec) if spec.endswith(".tar") else ManifestSource(spec)
    indexed = open_indexed(spec, load_tokenizer(tok_path), 77)
    rows = np.random.default_rng(0).permutation(len(indexed))[:count].tolist()

    def cost(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.process_time()
            for i in rows:
                fn(i)
            best = min(best, (time.process_time() - started) / count * 1e6)
        return best

    out = [("eager source: row + read_image", cost(lambda i: (eager.row(i), eager.read_image(i)))),
           ("indexed: row + read_image", cost(lambda i: (indexed.row(i), indexed.read_image(i)))),
           ("indexed: row alone", cost(indexed.row))]
    if spec.endswith(".tar"):
        c = indexed.columns

        def span(i: int) -> bytes:
            return indexed._read(indexed.files[int(c["line"][i])], int(c["offset"][i]), int(c["length"][i]))

        spans = {i: span(i) for i in rows}
        out += [("indexed: pread of the span alone", cost(span)),
                ("indexed: span_members (tarfile on the span) alone", cost(lambda i: span_members(spans[i]))),
                ("the span's headers walked without tarfile (tar_walk)", cost(lambda i: tar_walk(spans[i])))]
    return out


# -- mixing ----------------------------------------------------------------------------------------


def mixing(spec: str, tok_path: str, steps: int = 50) -> list[tuple]:
    """Distinct shards in a batch, and the largest share one shard has of a batch."""
    ds = build_dataset(data_config(spec, tok_path, 0), "train", load_tokenizer(tok_path), plan_aware=True)
    table = ds.table()
    out = []
    for window in (WINDOW, 0):
        sampler = DistributedBatchSampler(table, Schedule(batch_size=BATCH, seed=0, window=window), rank=0, world_size=WORLD)
        batches = sampler.plan().batches
        shards = [np.searchsorted(table.blocks, batches[k], side="right") - 1 for k in range(min(steps, len(batches)))]
        distinct = np.mean([len(np.unique(s)) for s in shards])
        top = np.mean([np.bincount(s).max() / len(s) for s in shards])
        out.append((window, distinct, top))
    return out


# -- report ----------------------------------------------------------------------------------------


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return ""


def print_build(builds: dict, walks: dict, disk: dict) -> None:
    print("| data | rows | index build s | rows/s | rows per CPU-s (per core) | each build, rows per CPU-s "
          "| data MB/s | disk MB/s (cold) | tar header walk, rows/CPU-s | token counts s | captions per CPU-s "
          "| index bytes/row |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for (kind, rows), b in builds.items():
        disk_rate = f"{disk[kind, rows] / 1e6:,.0f}" if (kind, rows) in disk else "-"
        walk = f"{walks[kind]:,.0f}" if kind in walks else "-"
        tokens = (f"{b['tokens_wall_s']:.1f} | {b['rows'] / b['tokens_cpu_s']:,.0f}" if "tokens_cpu_s" in b
                  else "- | -")
        print(f"| {kind} | {b['rows']:,} | {b['wall_s']:.1f} | {b['rows'] / b['wall_s']:,.0f} | "
              f"{b['rows'] / b['cpu_s']:,.0f} | {', '.join(f'{x:,.0f}' for x in b['each'])} | "
              f"{b['data_bytes'] / b['wall_s'] / 1e6:.0f} | {disk_rate} | {walk} | "
              f"{tokens} | {b['index_bytes'] / b['rows']:.1f} |")


def growth(run: dict, base: dict, rows: int) -> tuple[float, float]:
    """Bytes per sample of the node (all PSS) and of one rank process (its USS), over the baseline."""
    node = (run["node_pss"] - base["node_pss"]) / (rows - TINY)
    rank = (max(r["uss"] for r in run["ranks"]) - max(r["uss"] for r in base["ranks"])) / (rows - TINY)
    return node, rank


def print_first(firsts: dict, bases: dict) -> None:
    print(f"| data | rows | path | first batch s (rank 0 / 1) | of it, opening s | rank USS | rank PSS "
          f"| workers PSS (per rank) | node PSS ({WORLD} ranks + workers) | node growth | growth B/sample (node) "
          "| B/sample (one rank's USS) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (kind, rows, mode), r in firsts.items():
        base = bases[kind, mode]
        node, rank = growth(r, base, rows)
        ranks = r["ranks"]
        print(f"| {kind} | {rows:,} | {mode} | {r['first_s'][0]:.2f} / {r['first_s'][1]:.2f} | "
              f"{max(r['open_s']):.2f} | {fmt_bytes(max(x['uss'] for x in ranks))} | "
              f"{fmt_bytes(max(x['pss'] for x in ranks))} | {fmt_bytes(max(x['workers_pss'] for x in ranks))} | "
              f"{fmt_bytes(r['node_pss'])} | {fmt_bytes(r['node_pss'] - base['node_pss'])} | {node:.1f} | {rank:.1f} |")
    print(f"\nbaselines ({TINY:,} rows, same processes): " + "; ".join(
        f"{k} {m}: node PSS {fmt_bytes(b['node_pss'])}" for (k, m), b in bases.items()))


def first_at_target(firsts: dict, kind: str, mode: str) -> float | None:
    """Seconds to the first batch at TARGET_ROWS, from the largest measured size. The windowed
    plan does O(blocks + one window) work, so its time is taken as it is; the full permutation's
    plan is O(rows) and scales with them."""
    runs = [(rows, max(r["first_s"])) for (k, rows, m), r in firsts.items() if k == kind and m == mode]
    if not runs:
        return None
    rows, took = max(runs)
    return took if mode == "window" else took * TARGET_ROWS / rows


def print_extrapolation(builds: dict, firsts: dict, bases: dict, cores: int = 64) -> None:
    print(f"| data | path | index on disk | index build on {cores} cores | token counts on {cores} cores "
          f"| node memory growth ({WORLD} ranks) | one rank's growth | first batch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in sorted({k for k, _ in builds}):
        largest = max(r for k, r in builds if k == kind)
        per_core = builds[kind, largest]["rows"] / builds[kind, largest]["cpu_s"]
        counted = [b for (k, _), b in builds.items() if k == kind and "tokens_cpu_s" in b]
        tokens = f"{TARGET_ROWS / (counted[-1]['rows'] / counted[-1]['tokens_cpu_s'] * cores) / 60:.0f} min" \
            if counted else "-"
        for mode in ("window", "full"):
            runs = [(rows, r) for (k, rows, m), r in firsts.items() if k == kind and m == mode]
            if not runs:
                continue
            rows, run = max(runs, key=lambda x: x[0])
            node, rank = growth(run, bases[kind, mode], rows)
            first = first_at_target(firsts, kind, mode)
            first = "-" if first is None else f"{first:.1f} s" if first < 600 else f"{first / 60:.0f} min"
            print(f"| {kind} | {mode} | {fmt_bytes(BYTES_PER_SAMPLE * TARGET_ROWS)} | "
                  f"{TARGET_ROWS / (per_core * cores) / 60:.1f} min | {tokens} | "
                  f"{fmt_bytes(max(node, 0) * TARGET_ROWS)} | {fmt_bytes(max(rank, 0) * TARGET_ROWS)} | {first} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[100_000])
    p.add_argument("--kinds", nargs="+", default=["jsonl", "shards"], choices=["jsonl", "shards", "parquet"],
                   help="parquet: Hub-style files of 100,000 rows, row groups of 1,000 (no eager path)")
    p.add_argument("--workdir", default="/tmp/vltrain-data-scale")
    p.add_argument("--eager-max", type=int, default=1_000_000, help="largest size the old eager path opens")
    p.add_argument("--tokens-max", type=int, default=1_000_000,
                   help="largest size whose caption token counts are made and timed")
    p.add_argument("--batches", type=int, default=60, help="batches timed per loader pass")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-loader", action="store_true", help="skip the loader throughput table")
    p.add_argument("--build-only", action="store_true",
                   help="only the index build table (no first batch, memory, loader, mixing or extrapolation)")
    p.add_argument("--build-repeats", type=int, default=1,
                   help="index builds of each data set; the table shows the median and each build's rate")
    p.add_argument("--rank-job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_job:
        return rank_main(json.loads(args.rank_job))
    run(args)


def run(args) -> None:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    names, captions = make_assets(work)
    tok = tokenizer_path(work, captions)
    cores = os.cpu_count() or 1
    builds, walks, disk, firsts, bases = {}, {}, {}, {}, {}
    modes = [] if args.build_only else ["window", "full", "eager"]
    for kind in args.kinds:
        if modes:
            tiny = dataset(work, kind, TINY, names, captions)
            time_build(tiny, tok, cores, tokens=True)
        for mode in modes:
            if mode != "eager" or kind != "parquet":  # parquet has no eager path
                bases[kind, mode] = run_ranks(tiny, tok, mode)
        for rows in args.rows:
            spec = dataset(work, kind, rows, names, captions)
            if kind == "shards":
                disk[kind, rows] = disk_read_rate(data_files(spec))
            runs = [time_build(spec, tok, cores, tokens=k == 0 and rows <= args.tokens_max)
                    for k in range(args.build_repeats)]
            median = sorted(runs, key=lambda b: b["cpu_s"])[len(runs) // 2]  # its token counts: the first's
            builds[kind, rows] = {**runs[0], **median, "each": [b["rows"] / b["cpu_s"] for b in runs]}
            print(f"built {kind} {rows:,}: {builds[kind, rows]}", file=sys.stderr)
            if kind == "shards" and kind not in walks:
                walks[kind] = tar_walk_rate(spec)
            for mode in modes:
                if mode != "eager" or (rows <= args.eager_max and kind != "parquet"):
                    if mode == "eager" and kind == "shards":
                        ShardSource(spec)  # its per-shard JSON indexes, built once, outside the timing
                    firsts[kind, rows, mode] = run_ranks(spec, tok, mode)
                    print(f"first batch {kind} {rows:,} {mode}: {json.dumps(firsts[kind, rows, mode])}", file=sys.stderr)
    report(args, work, tok, builds, walks, disk, firsts, bases)


def report(args, work, tok, builds, walks, disk, firsts, bases) -> None:
    print(f"\n{platform.machine()}, {os.cpu_count()} CPUs; load average %.1f / %.1f / %.1f; " % os.getloadavg()
          + f"vltrain from {REPO / 'src'}\n")
    print_build(builds, walks, disk)
    print()
    if args.build_only:
        return
    print_first(firsts, bases)
    print()
    small = min(args.rows)
    if not args.no_loader:
        specs = {kind: dataset(work, kind, small, *make_assets(work)) for kind in args.kinds}
        print(f"loader samples/s on {small:,} rows (1 rank, batch {BATCH}, {LOADER_WORKERS} workers, "
              f"{args.batches} batches a pass, {args.repeats} passes)\n")
        print("| data | path | samples/s (best) | vs eager (best) | vs eager (median of paired passes) |")
        print("|---|---|---:|---:|---:|")
        for kind, mode, rate, best, median in loader_table(specs, tok, args.batches, args.repeats):
            print(f"| {kind} | {mode} | {rate:,.0f} | {best:.2f}x | {median:.2f}x |")
        print()
        print("| per sample, before decoding (CPU us, 5,000 random rows, best of 3) | " + " | ".join(args.kinds) + " |")
        print("|---|" + "---:|" * len(args.kinds))
        costs = {kind: dict(read_costs(spec, tok)) for kind, spec in specs.items()}
        for what in dict.fromkeys(w for c in costs.values() for w in c):
            print(f"| {what} | " + " | ".join(f"{costs[k][what]:.1f}" if what in costs[k] else "-"
                                               for k in args.kinds) + " |")
        print()
    if "shards" in args.kinds:
        spec = dataset(work, "shards", small, *make_assets(work))
        print(f"mixing on {small:,} rows in shards of {shards_per(small):,} (rank 0's first 50 batches of {BATCH})\n")
        print("| shuffle_window | distinct shards per batch | largest share of one shard |")
        print("|---:|---:|---:|")
        for window, distinct, top in mixing(spec, tok):
            print(f"| {window or 'full permutation'} | {distinct:.1f} | {top:.3f} |")
        print()
    print(f"extrapolated to {TARGET_ROWS:,} rows from the largest size measured (first batch: as measured with "
          "the windowed shuffle, whose plan is O(blocks); proportional to rows with the full permutation)\n")
    print_extrapolation(builds, firsts, bases)


if __name__ == "__main__":
    main()
