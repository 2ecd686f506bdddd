"""What the stored size of an image costs the loader: decode and resize to 224 per image, per core.

Makes ``--num`` photo-like 1024x768 JPEGs (quality 95: smooth colour fields, shapes and noise,
``data_pipeline.photo``), then stores each as people do: the original, a 500x375 web photo, and
shorter sides of 512 (DataComp), 384 and 256 (img2dataset's default) written by ``vltrain data
shard --image-size N`` (``vltrain.data.tools.convert.resizer``, quality 95). Each is decoded and
resized to 224x224 by vltrain's own loader path (``decode_image``, centre crop, bicubic), in one
thread, as a loader worker does; the baseline of the ratio is the 500x375 photo, decoded in the
same run.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode_cost.py --num 200
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from data_pipeline import photo  # noqa: E402
from peer_loader import cpu_name  # noqa: E402

from vltrain.data.images import decode_image  # noqa: E402
from vltrain.data.tools.convert import resizer  # noqa: E402


def jpeg(im, quality: int = 95) -> bytes:
    out = io.BytesIO()
    im.save(out, "JPEG", quality=quality)
    return out.getvalue()


def stored(num: int) -> dict[str, list[bytes]]:
    rng = np.random.default_rng(0)
    originals = [jpeg(photo(rng, 1024, 768)) for _ in range(num)]
    out = {"1024x768 (original)": originals,
           "500x375 (web photo)": [jpeg(photo(np.random.default_rng(k), 500, 375)) for k in range(num)]}
    for side in (512, 384, 256):
        resize = resizer(side, 95)
        out[f"shorter side {side}"] = [resize(data, "x.jpg")[0] for data in originals]
    return out


def ms_per_image(images: list[bytes], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for data in images:
            decode_image(data, 224)
        best = min(best, (time.process_time() - start) / len(images) * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sets = stored(args.num)
    costs = {name: ms_per_image(images, args.repeats) for name, images in sets.items()}
    base = costs["500x375 (web photo)"]
    print(f"decode + resize to 224, 1 thread, {args.num} images, best of {args.repeats}; {cpu_name()}")
    print(f"| stored as | KB per image | ms per image per core | vs 500x375 |")
    print("|---|---:|---:|---:|")
    for name, images in sets.items():
        kb = sum(map(len, images)) / len(images) / 1024
        print(f"| {name} | {kb:.1f} | {costs[name]:.2f} | {costs[name] / base:.2f}x |")


if __name__ == "__main__":
    main()
