"""How well the windowed shuffle mixes, against a full permutation, and what each costs a rank.

Data: ``--rows`` samples in shards of ``--shard`` rows (a shard is one block of the windowed
shuffle). For each setting the epoch-0 plan of one rank is cut into batches of ``--batch`` rows,
and over the first ``--batches`` batches:

- shards per batch: how many distinct shards a batch's rows come from;
- same-shard pairs: the share of batch-mate pairs that sit in one shard (shards often hold one
  crawl domain or one caption style, so this is the correlation a batch sees);
- distance: the mean distance in the source between consecutive batch-mates, as a share of the
  dataset (a random pair is 1/3 apart);
- plan memory: what the rank holds to produce its batches (the permutation, or block order plus one
  window); first batch: time from creating the sampler to its first batch.

The last rows are a weighted mixture of two sources, the second a quarter of the rows drawn for
half of each epoch (``source_weights`` 1:1), so it repeats within the epoch. The windowed
mixture's plan memory counts every array the sampler holds (its caches included).

    PYTHONPATH=src python benchmarks/shuffle_quality.py --rows 1000000 --shard 1000
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.data.table import SampleTable


def table(rows: int, shard: int) -> SampleTable:
    return SampleTable(
        has_image=np.ones(rows, bool), has_text=np.ones(rows, bool), text_len=np.full(rows, 20, np.uint16),
        source=np.broadcast_to(np.int16(0), (rows,)), blocks=np.r_[np.arange(0, rows, shard), rows],
    )


def mixed(t: SampleTable) -> SampleTable:
    """``t`` as two sources, the second its last quarter of rows."""
    source = np.repeat(np.array([0, 1], np.int16), [len(t) - len(t) // 4, len(t) // 4])
    return SampleTable(t.has_image, t.has_text, t.text_len, source, blocks=t.blocks)


def held(obj, seen: set) -> int:
    """Bytes of the numpy arrays reachable from ``obj``, the sample table left out."""
    if id(obj) in seen or isinstance(obj, SampleTable):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    values = obj.values() if isinstance(obj, dict) else vars(obj).values() if hasattr(obj, "__dict__") else \
        obj if isinstance(obj, (list, tuple)) else ()
    return sum(held(v, seen) for v in values)


def measure(t: SampleTable, window: int, args, weights: list[float] | None = None) -> dict:
    started = time.perf_counter()
    schedule = Schedule(batch_size=args.batch, seed=0, window=window, source_weights=weights)
    sampler = DistributedBatchSampler(t, schedule, rank=0, world_size=args.world)
    first = next(iter(sampler))
    took = time.perf_counter() - started
    plan = sampler.plan()
    shards, same, dist = [], [], []
    for k in range(min(args.batches, len(plan))):
        b = np.asarray(plan.batches[k] if k else first)
        s = b // args.shard
        shards.append(len(np.unique(s)))
        counts = np.bincount(s)
        same.append(float((counts * (counts - 1)).sum()) / (len(b) * (len(b) - 1)))
        dist.append(float(np.abs(np.diff(b)).mean()) / len(t))
    if window and weights:
        memory = held(sampler, set())
    elif window:
        order = plan.batches.order
        memory = order.block_order.nbytes + order.window_starts.nbytes + sum(w.nbytes for w in order._cached.values())
    else:
        arrays = {id(a.base if a.base is not None else a): (a.base if a.base is not None else a)
                  for a in [*plan.batches, *plan.repeats]}  # batches are views of the whole epoch's order
        memory = sum(a.nbytes for a in arrays.values())
    return {"shards": np.mean(shards), "same": np.mean(same), "dist": np.mean(dist), "memory": memory, "first": took}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--shard", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--mixture-window", type=int, default=16)
    args = p.parse_args()
    t = table(args.rows, args.shard)
    print(f"{args.rows:,} rows in shards of {args.shard:,}; batch {args.batch}, {args.world} ranks (rank 0 shown)\n")
    print("| shuffle | shards per batch | same-shard pairs | distance | plan memory per rank | first batch |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [(t, w, None, "full permutation" if w == 0 else f"window of {w} shard(s)") for w in [0, *args.windows]]
    rows += [(mixed(t), w, [1.0, 1.0], "mixture, full order" if w == 0 else f"mixture, window of {w} shard(s)")
             for w in [0, args.mixture_window]]
    for data, window, weights, name in rows:
        r = measure(data, window, args, weights)
        print(f"| {name} | {r['shards']:.1f} | {r['same']:.4f} | {r['dist']:.3f} | "
              f"{r['memory'] / 2**20:.1f} MiB | {r['first'] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
