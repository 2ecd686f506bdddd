"""Hub parquet from local disk, from an S3 server through the shard cache, and once cached.

Writes ``--files`` Hub-style parquet files (``datasets`` Image feature, row groups of 100) of
``--rows`` photo-like 256x256 JPEGs each (``peer_loader.make_parquet``), uploads them to moto's S3
server on 127.0.0.1 (its own process, ``remote_shards.start_server``), and reads every sample
through the sample index (``open_indexed``: the row's text and image, the image decoded to 224 by
``decode_image``), in index order, one thread:

  local:  the files on disk;
  cold:   ``s3://`` with a fresh cache folder: each file downloaded whole on first use, the next
          two prefetched (``source.prefetch``) as the reader moves on;
  cached: the same source again, every file now in the cache.

Index builds are outside the timing (each setting's source is opened first). Samples per second,
the best of ``--repeats`` passes, and the median ratio of each pass to the local pass next to it.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/remote_parquet.py [--files 4] [--rows 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vltrain.data.images import decode_image
from vltrain.data.index.open import open_indexed
from vltrain.data.sources.remote import filesystem


def read_all(source, files: int) -> float:
    """Samples/s reading and decoding every row, prefetching the next two files as it goes."""
    file_of = np.asarray(source.columns["line"])
    started = time.perf_counter()
    current = -1
    for i in range(len(source)):
        if file_of[i] != current:
            current = int(file_of[i])
            ahead = np.flatnonzero((file_of > current) & (file_of <= current + 2))
            if len(ahead):
                source.prefetch(ahead[[0, -1]])
        source.row(i)
        decode_image(source.read_image(i), 224)
    return len(source) / (time.perf_counter() - started)


def main() -> None:
    from peer_loader import cpu_name, make_pairs, make_parquet  # benchmarks/ is on sys.path
    from remote_shards import start_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    proc, endpoint = start_server()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    runs = []
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            jpegs, texts = make_pairs(args.files * args.rows)
            pattern = make_parquet(tmp, jpegs, texts, args.files, 100)
            fs, _ = filesystem("s3://bench")
            fs.mkdir("bench")
            for p in sorted((tmp / "data").glob("*.parquet")):
                fs.put_file(str(p), f"bench/{p.name}")
            url = "s3://bench/" + pattern.rsplit("/", 1)[1]
            mb = sum(p.stat().st_size for p in (tmp / "data").glob("*.parquet")) / 2**20
            open_indexed(url, None, 77, cache_dir=tmp / "index-cache")  # the remote index, built once
            for r in range(args.repeats):
                local = open_indexed(pattern, None, 77)
                run = {"local": read_all(local, args.files)}
                remote = open_indexed(url, None, 77, cache_dir=tmp / "index-cache")
                shutil.rmtree(remote.cache.root, ignore_errors=True)  # the downloads gone, the index kept: cold
                run["cold"] = read_all(remote, args.files)
                run["cached"] = read_all(open_indexed(url, None, 77, cache_dir=tmp / "index-cache"), args.files)
                runs.append(run)
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"{args.files} parquet files x {args.rows} JPEGs (256x256), {mb:.1f} MiB; decode to 224; "
          f"{cpu_name()}, {os.cpu_count()} CPUs")
    print("| setting | samples/s (best) | vs local (best) | vs local (median of paired passes) |")
    print("|---|---:|---:|---:|")
    best = {k: max(r[k] for r in runs) for k in runs[0]}
    for name in ("local", "cold", "cached"):
        paired = float(np.median([r[name] / r["local"] for r in runs]))
        print(f"| {name} | {best[name]:.0f} | {best[name] / best['local']:.2f}x | {paired:.2f}x |")


if __name__ == "__main__":
    main()
