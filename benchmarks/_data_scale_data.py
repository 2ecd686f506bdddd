"""The data sets of ``data_scale.py``: a JSONL manifest or tar shards of N rows, written once; and
reading them back (the disk's rate, a plain tar header walk).

32 small images (48 px shapes from ``vltrain.data.tools.synth``, PNG and JPEG) reused cyclically; captions
from ``synth.describe``; a unique id per row (the manifest's ``id``, the shard member's key).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from vltrain.data.sources.shards import shard_paths
from vltrain.data.tools.synth import describe, render, sample_scene

IMAGES, WORDINGS = 32, 128
PARQUET_PER_FILE, PARQUET_ROW_GROUP = 100_000, 1000
BLOCK = tarfile.BLOCKSIZE


def make_assets(work: Path) -> tuple[list[str], list[list[str]]]:
    """32 images (even: PNG, odd: JPEG) and, per image, 128 wordings of its caption."""
    (work / "images").mkdir(parents=True, exist_ok=True)
    names, captions = [], []
    for k in range(IMAGES):
        rng = random.Random(f"data-scale/{k}")
        shapes = sample_scene(rng)
        name = f"{k:02d}.{'jpg' if k % 2 else 'png'}"
        if not (work / "images" / name).is_file():
            render(shapes, 48, rng).save(work / "images" / name, quality=85)
        names.append(name)
        captions.append([describe(shapes, rng) for _ in range(WORDINGS)])
    return names, captions


def row_assets(i: int) -> tuple[int, int]:
    """(image, wording) of row ``i``."""
    return i % IMAGES, (i // IMAGES) % WORDINGS


def write_jsonl(path: Path, rows: int, names: list[str], captions: list[list[str]]) -> None:
    quoted = [[json.dumps(c) for c in cs] for cs in captions]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for lo in range(0, rows, 100_000):
            lines = []
            for i in range(lo, min(rows, lo + 100_000)):
                k, w = row_assets(i)
                lines.append(f'{{"id": "r{i:010d}", "image": "../images/{names[k]}", "text": {quoted[k][w]}}}\n')
            f.write("".join(lines))
    os.replace(tmp, path)


def _member(name: bytes, data: bytes, templates: dict) -> bytes:
    """A tar member (GNU header, data padded to 512) built from a per-size header template."""
    key = (len(name), len(data))
    if key not in templates:
        info = tarfile.TarInfo("x" * len(name))
        info.size, info.mode = len(data), 0o644
        head = bytearray(info.tobuf(tarfile.GNU_FORMAT))
        base = sum(head) - sum(head[148:156]) + 8 * 32 - sum(head[: len(name)])
        templates[key] = (bytes(head), base)
    head, base = templates[key]
    out = bytearray(head)
    out[: len(name)] = name
    out[148:155] = b"%06o\x00" % (base + sum(name))
    return bytes(out) + data + bytes(-len(data) % BLOCK)


def write_shard(job: tuple[str, int, int, int, list[bytes], list[str], list[list[str]]]) -> None:
    path, shard, lo, hi, images, names, captions = job
    exts = [n.rsplit(".", 1)[1].encode() for n in names]
    texts = [[c.encode() for c in cs] for cs in captions]
    templates: dict = {}
    parts = []
    for i in range(lo, hi):
        k, w = row_assets(i)
        key = b"%05d%05d" % (shard, i - lo)
        parts.append(_member(key + b"." + exts[k], images[k], templates))
        parts.append(_member(key + b".txt", texts[k][w], templates))
    body = b"".join(parts) + bytes(2 * BLOCK)
    body += bytes(-len(body) % tarfile.RECORDSIZE)
    with open(path + ".tmp", "wb") as f:
        f.write(body)
    os.replace(path + ".tmp", path)


def write_shards(folder: Path, rows: int, per_shard: int, work: Path, names, captions) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    images = [(work / "images" / n).read_bytes() for n in names]
    jobs = [(str(folder / f"{s:05d}.tar"), s, lo, min(rows, lo + per_shard), images, names, captions)
            for s, lo in enumerate(range(0, rows, per_shard))]
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(write_shard, jobs, chunksize=4))


def write_parquet_file(job: tuple[str, int, int, list[bytes], list[list[str]]]) -> None:
    """One Hub-style parquet file (an Image ``{bytes, path}`` struct and ``text``), row groups of
    ``PARQUET_ROW_GROUP`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, lo, hi, images, captions = job
    assets = [row_assets(i) for i in range(lo, hi)]
    image = pa.StructArray.from_arrays([pa.array([images[a] for a, _ in assets], pa.binary()),
                                        pa.array([None] * len(assets), pa.string())], ["bytes", "path"])
    text = pa.array([captions[a][w] for a, w in assets], pa.string())
    pq.write_table(pa.table({"image": image, "text": text}), path + ".tmp", row_group_size=PARQUET_ROW_GROUP)
    os.replace(path + ".tmp", path)


def write_parquet(folder: Path, rows: int, per_file: int, work: Path, names, captions) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    images = [(work / "images" / n).read_bytes() for n in names]
    count = -(-rows // per_file)
    jobs = [(str(folder / f"train-{k:05d}-of-{count:05d}.parquet"), lo, min(rows, lo + per_file), images, captions)
            for k, lo in enumerate(range(0, rows, per_file))]
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(write_parquet_file, jobs))


def shards_per(rows: int) -> int:
    return 1000 if rows <= 1_000_000 else 10_000


def dataset(work: Path, kind: str, rows: int, names, captions) -> str:
    """The data's spec (a manifest, a shard pattern, or a pattern of parquet files), written unless
    already there."""
    folder = work / f"{kind}-{rows}"
    done = folder / ".written"
    if kind == "jsonl":
        spec = str(folder / "train.jsonl")
    elif kind == "parquet":
        count = -(-rows // PARQUET_PER_FILE)
        spec = f"{folder}/train-{{00000..{count - 1:05d}}}-of-{count:05d}.parquet"
    else:
        count = -(-rows // shards_per(rows))
        spec = f"{folder}/{{00000..{count - 1:05d}}}.tar"
    if not done.is_file():
        started = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        if kind == "jsonl":
            write_jsonl(Path(spec), rows, names, captions)
        elif kind == "parquet":
            write_parquet(folder, rows, PARQUET_PER_FILE, work, names, captions)
        else:
            write_shards(folder, rows, shards_per(rows), work, names, captions)
        done.write_text("")
        print(f"wrote {kind} {rows:,} rows in {time.monotonic() - started:.0f} s: {spec}", file=sys.stderr)
    return spec


# -- reading it back -------------------------------------------------------------------------------


def drop_cache(files: list[str]) -> None:
    """Evict the files' clean pages from the page cache (no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def disk_read_rate(files: list[str], limit: int = 2 << 30) -> float:
    """Bytes/s reading the files (up to ``limit`` bytes) sequentially from a cold page cache."""
    drop_cache(files)
    done, started = 0, time.monotonic()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(8 << 20):
                done += len(chunk)
        if done >= limit:
            break
    return done / (time.monotonic() - started)


def tar_walk(data: bytes, texts: list | None = None) -> int:
    """Members of a tar held in ``data``, walked header to header (name, size) without tarfile;
    collects the .txt members' texts. The floor of what scanning a shard costs in Python."""
    pos = members = 0
    while pos + BLOCK <= len(data) and data[pos]:
        name = data[pos : pos + 100].split(b"\0", 1)[0]
        size = int(data[pos + 124 : pos + 136].split(b"\0", 1)[0].strip() or b"0", 8)
        if texts is not None and name.endswith(b".txt"):
            texts.append(data[pos + BLOCK : pos + BLOCK + size].decode("utf-8"))
        pos += BLOCK + -(-size // BLOCK) * BLOCK
        members += 1
    return members


def tar_walk_rate(spec: str, rows: int = 100_000) -> float:
    """Samples per CPU-second of :func:`tar_walk` over whole shards (read included)."""
    started, texts = time.process_time(), []
    for path in shard_paths(spec):
        with open(path, "rb") as f:
            tar_walk(f.read(), texts)
        if len(texts) >= rows:
            break
    return len(texts) / (time.process_time() - started)
