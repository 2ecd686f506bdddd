"""``vltrain data shard``'s work beyond copying: images resized as they are written (decoding a
stored 256 px JPEG costs a third of a 500 px photo: docs/formats.md, pre-resized shards), and
parquet files in the Hugging Face layout, so that tar shards and parquet convert both ways.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Callable

from PIL import Image

from vltrain.data.images import upright
from vltrain.data.regions import resized_regions
from vltrain.data.sources.manifests import Problem, Source
from vltrain.data.sources.parquet import require_pyarrow
from vltrain.errors import UserError

DEFAULT_QUALITY = 95
"""img2dataset's default JPEG quality."""


def resizer(size: int, quality: int = DEFAULT_QUALITY) -> Callable[[bytes, str], tuple[bytes, str]]:
    """``(bytes, name) -> (bytes, extension)``: the image with its shorter side ``size`` px, aspect
    kept, as a JPEG of ``quality`` (a PNG when it has transparency). An image already that small
    or smaller is kept as it is: resizing up adds bytes and no detail."""
    if size < 1:
        raise UserError(f"--image-size must be >= 1, got {size}")
    if not 1 <= quality <= 100:
        raise UserError(f"--quality must be in [1, 100], got {quality}")

    def resize(data: bytes, name: str) -> tuple[bytes, str]:
        try:
            return _resized(data, name)
        except Exception as e:  # PIL raises OSError, ValueError, DecompressionBombError, ...
            raise ValueError(f"cannot be resized ({type(e).__name__}: {e})") from e

    def _resized(data: bytes, name: str) -> tuple[bytes, str]:
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        scale = size / min(w, h)
        if scale >= 1:
            return data, name.rsplit(".", 1)[-1].lower() if "." in name else "png"
        im.draft("RGB", (max(1, round(w * scale)), max(1, round(h * scale))))  # a JPEG decodes smaller directly
        im = upright(im)  # as the decoders show it: a rotated photo's sides swap
        alpha = im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info
        im = im.convert("RGBA" if alpha else "RGB")
        scale = size / min(im.size)
        target = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
        if im.size != target:
            im = im.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
        out = io.BytesIO()
        if alpha:
            im.save(out, "PNG")
            return out.getvalue(), "png"
        im.save(out, "JPEG", quality=quality)
        return out.getvalue(), "jpg"

    return resize


HF_FEATURES = {"image": {"_type": "Image"}, "text": {"dtype": "string", "_type": "Value"},
               "id": {"dtype": "string", "_type": "Value"}}
"""The ``datasets`` features the files declare, so ``load_dataset('parquet', ...)`` decodes the
image column as its Image feature."""


def write_parquet(source: Source, out: str | os.PathLike, rows_per_file: int, row_group: int = 100,
                  transform: Callable[[bytes, str], tuple[bytes, str]] | None = None,
                  ) -> tuple[list[Path], list[Problem]]:
    """Every readable row of ``source`` into ``out/train-0000K-of-0000N.parquet`` as the Hub lays
    image-text sets out: an ``image`` struct {bytes, path} (null for a text-only row), ``text``
    and ``id``, ``row_group`` rows per row group; and when a row has regions, ``regions``, each
    row's as JSON text (their boxes scaled with a resized image). Unreadable images are skipped and
    returned."""
    pq = require_pyarrow()
    import pyarrow as pa

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = max(1, -(-len(source) // rows_per_file))
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    columns, features = [("image", image_type), ("text", pa.string()), ("id", pa.string())], dict(HF_FEATURES)
    with_regions = any(source.row(i).regions is not None for i in range(len(source)))  # every file's columns
    if with_regions:
        columns.append(("regions", pa.string()))
        features["regions"] = {"dtype": "string", "_type": "Value"}
    schema = pa.schema(columns, metadata={"huggingface": json.dumps({"info": {"features": features}})})
    written: list[Path] = []
    skipped: list[Problem] = []
    for k in range(files):
        rows: dict[str, list] = {name: [] for name in schema.names}
        for i in range(k * rows_per_file, min(len(source), (k + 1) * rows_per_file)):
            row = source.row(i)
            image, regions = None, row.regions
            if row.image is not None:
                try:
                    data, name = source.read_image(i), row.image.rsplit("/", 1)[-1].rsplit(":", 1)[-1]
                    if transform is not None:
                        stored, (data, ext) = data, transform(data, name)
                        name = f"{name.rsplit('.', 1)[0]}.{ext}"
                        regions = regions if regions is None else resized_regions(regions, stored, data)
                    image = {"bytes": data, "path": name}
                except (OSError, ValueError) as e:
                    skipped.append(Problem(row.where, f"image {row.image} not copied: {e}"))
                    continue
            rows["image"].append(image)
            rows["text"].append(row.text)
            rows["id"].append(row.key)
            if with_regions:
                as_text = regions is None or isinstance(regions, str)
                rows["regions"].append(regions if as_text else json.dumps(regions, ensure_ascii=False))
        path = out / f"train-{k:05d}-of-{files:05d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(pa.table(rows, schema=schema), tmp, row_group_size=row_group)
        os.replace(tmp, path)
        written.append(path)
    return written, skipped
