"""Reading tar shards from a local S3 server through the shard cache, against local disk.

Writes ``--shards`` tar shards of ``--per-shard`` photo-like JPEGs (500x375, quality 90) and
uploads them to moto's S3 server, started as its own process on 127.0.0.1 (so that serving does
not share this process's interpreter). Then times one pass that reads every sample (one seek and
one read per image, offsets from the tar headers) and decodes it to 224x224 as the loader does
(``decode_image``), in three settings:

  local:  the shards on local disk;
  cold:   from ``s3://``, a fresh cache: each shard is downloaded whole before it is read, with
          the next two prefetched in the background while the current one is read;
  cached: from ``s3://`` again, every shard now in the cache (one ``open`` per shard, a hit).

One process, one reading thread, wall-clock rates (the cold pass overlaps downloads with decoding,
which is the point of prefetching). Each setting runs ``--repeats`` times, the three back to back
(cold: a new cache each time); the table gives the best rate of each, and the median over repeats
of each pass's rate over the local pass next to it, which drifts less on a busy machine.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/remote_shards.py [--shards 8] [--per-shard 100]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from vltrain.data.images import decode_image
from vltrain.data.sources.remote import filesystem
from vltrain.data.sources.shard_cache import ShardCache


def photo(rng: np.random.Generator, w: int = 500, h: int = 375) -> bytes:
    """A smooth gradient with blocks and sensor-like noise: JPEG-compresses like a photo."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    a = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], -1)
    for _ in range(6):
        x0, y0 = rng.integers(0, w - 60), rng.integers(0, h - 60)
        a[y0:y0 + rng.integers(20, 120), x0:x0 + rng.integers(20, 120)] = rng.integers(0, 255, 3)
    a += rng.normal(0, 6, a.shape)
    buf = io.BytesIO()
    Image.fromarray(a.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_shards(out: Path, shards: int, per_shard: int) -> list[Path]:
    rng = np.random.default_rng(0)
    images = [photo(rng) for _ in range(min(64, shards * per_shard))]
    paths = []
    for s in range(shards):
        paths.append(out / f"{s:05d}.tar")
        with tarfile.open(paths[-1], "w", format=tarfile.GNU_FORMAT) as tar:
            for i in range(per_shard):
                for ext, data in (("jpg", images[(s * per_shard + i) % len(images)]), ("txt", b"a photo")):
                    info = tarfile.TarInfo(f"{s:05d}{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return paths


def image_offsets(path: Path) -> list[tuple[int, int]]:
    with tarfile.open(path) as tar:
        return [(m.offset_data, m.size) for m in tar if m.name.endswith(".jpg")]


def read_all(files: list, offsets: list[list[tuple[int, int]]]) -> int:
    n = 0
    for f, offs in zip(files, offsets):
        for off, size in offs:
            f.seek(off)
            decode_image(f.read(size), 224)
            n += 1
        f.close()
    return n


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("moto server did not start")


def passes(urls, local, offsets, tmp: Path, repeats: int) -> list[dict[str, float]]:
    """samples/s of each setting, one dict per repeat (the three settings run back to back)."""
    n = sum(len(o) for o in offsets)
    runs: list[dict[str, float]] = []

    def keep(name: str, t: float) -> None:
        runs[-1][name] = n / t

    for r in range(repeats):
        runs.append({})
        t = time.perf_counter()
        read_all([open(p, "rb") for p in local], offsets)
        keep("local", time.perf_counter() - t)
        cache = ShardCache(tmp / f"cache{r}", 10**10)
        t = time.perf_counter()
        files = []
        for i, u in enumerate(urls):  # open each shard as its reader gets to it, prefetching the next
            cache.prefetch(urls[i + 1:i + 3])
            files.append(cache.open(u))
            read_all([files[-1]], [offsets[i]])
        keep("cold", time.perf_counter() - t)
        t = time.perf_counter()
        read_all([cache.open(u) for u in urls], offsets)
        keep("cached", time.perf_counter() - t)
        assert cache.stats.downloads == len(urls), cache.stats
        cache.close()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    proc, endpoint = start_server()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            local = write_shards(tmp, args.shards, args.per_shard)
            fs, _ = filesystem("s3://bench")
            fs.mkdir("bench")
            urls = []
            for p in local:
                fs.put_file(str(p), f"bench/{p.name}")
                urls.append(f"s3://bench/{p.name}")
            offsets = [image_offsets(p) for p in local]
            mb = sum(p.stat().st_size for p in local) / 2**20
            runs = passes(urls, local, offsets, tmp, args.repeats)
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"{args.shards} shards x {args.per_shard} JPEGs (500x375), {mb:.1f} MiB; decode to 224; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"| {'setting':<8} | samples/s (best) | vs local (best) | vs local (median of paired passes) |")
    print("|----------|------------------|-----------------|------------------------------------|")
    best = {k: max(r[k] for r in runs) for k in runs[0]}
    for name in ("local", "cold", "cached"):
        paired = float(np.median([r[name] / r["local"] for r in runs]))
        print(f"| {name:<8} | {best[name]:16.0f} | {best[name] / best['local']:14.2f}x | {paired:33.2f}x |")


if __name__ == "__main__":
    main()
