"""Parquet files as people get them, for tests: written by the ``datasets`` library (a Hub dataset,
images embedded as ``push_to_hub`` does) and by pyarrow in img2dataset's parquet layout."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

from vltrain.data.tools.synth import describe, render, sample_scene


def shapes(n: int, seed: int = 0, size: int = 32, fmt: str = "PNG") -> list[tuple[bytes, str]]:
    """``n`` (encoded image, caption) pairs of the synthetic shapes."""
    out = []
    for i in range(n):
        rng = random.Random(f"parquet/{seed}/{i}")
        scene = sample_scene(rng)
        buf = io.BytesIO()
        render(scene, size, rng).save(buf, fmt, quality=90) if fmt == "JPEG" else render(scene, size, rng).save(buf, fmt)
        out.append((buf.getvalue(), describe(scene, rng)))
    return out


def hub_parquet(out: Path, pairs: list[tuple[bytes | None, str]], files: int, row_group: int,
                text_column: str = "text") -> list[Path]:
    """``out/data/train-0000K-of-0000N.parquet`` as the Hub serves them: the images are first
    files on disk, cast to the Image feature, then embedded into the table as ``push_to_hub`` does;
    ``row_group`` rows per row group."""
    from datasets import Dataset, Image
    from datasets.table import embed_table_storage

    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (data, _) in enumerate(pairs):
        p = images / f"{i:05d}.png"
        if data is not None:  # None: a text-only row
            p.write_bytes(data)
        paths.append(str(p) if data is not None else None)
    ds = Dataset.from_dict({"image": paths, text_column: [c for _, c in pairs]}).cast_column("image", Image())
    ds = ds.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)
    (out / "data").mkdir(parents=True, exist_ok=True)
    written = []
    for k in range(files):
        shard = ds.shard(num_shards=files, index=k, contiguous=True)
        path = out / "data" / f"train-{k:05d}-of-{files:05d}.parquet"
        shard.to_parquet(str(path), batch_size=row_group)
        written.append(path)
    return written


def img2dataset_parquet(path: Path, pairs: list[tuple[bytes, str]], failed: tuple[int, ...] = (),
                        row_group: int = 8) -> Path:
    """One parquet file in img2dataset's ``--output_format parquet`` layout (url, caption, key,
    status, error_message, width, height, original_width, original_height, exif, sha256, jpg); the
    rows in ``failed`` failed to download (no image, status ``failed_to_download``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {k: [] for k in ("url", "caption", "key", "status", "error_message", "width", "height",
                            "original_width", "original_height", "exif", "sha256", "jpg")}
    for i, (data, caption) in enumerate(pairs):
        bad = i in failed
        for k, v in (("url", f"http://127.0.0.1/{i}.jpg"), ("caption", caption), ("key", f"{i:09d}"),
                     ("status", "failed_to_download" if bad else "success"),
                     ("error_message", "HTTP Error 404" if bad else None), ("width", None if bad else 32),
                     ("height", None if bad else 32), ("original_width", None if bad else 32),
                     ("original_height", None if bad else 32), ("exif", None if bad else json.dumps({})),
                     ("sha256", None), ("jpg", None if bad else data)):
            rows[k].append(v)
    schema = pa.schema([("url", pa.string()), ("caption", pa.string()), ("key", pa.string()),
                        ("status", pa.string()), ("error_message", pa.string()), ("width", pa.int64()),
                        ("height", pa.int64()), ("original_width", pa.int64()), ("original_height", pa.int64()),
                        ("exif", pa.string()), ("sha256", pa.string()), ("jpg", pa.binary())])
    pq.write_table(pa.table(rows, schema=schema), path, row_group_size=row_group)
    return path
