"""What regions (boxes with a phrase) cost the loader: loading a sample, collating a batch, indexing.

Writes the synthetic shapes (``vltrain data synth``, 1 to 3 shapes per image, 96 px) twice, without
and with ``--regions``, and times on each, in one thread, as a loader worker runs (CPU time of the
process, the two kinds taking turns, best of ``--repeats``):

- **load**: ``dataset[i]`` of the training dataset (read, decode, crop to 64, tokenize; with regions
  also check, map and tokenize each phrase), per sample;
- **collate**: the collator on batches of ``--batch`` such samples, per batch;
- **index**: building the sample index of the manifest in one process (rows with regions hold
  lists, which the index build's one-call JSON parse of a chunk leaves to a parse per row), per
  1,000 rows.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/regions_cost.py --num 4000
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from peer_loader import cpu_name  # noqa: E402

from vltrain.data.config import DataConfig  # noqa: E402
from vltrain.data.dataset import build_dataset  # noqa: E402
from vltrain.data.index.open import open_indexed  # noqa: E402
from vltrain.data.loading.collate import Collator  # noqa: E402
from vltrain.data.tools.synth import synthesize, write_tokenizer  # noqa: E402


def timed(fn) -> float:
    """CPU seconds of this process for ``fn()`` (the machine may be shared: wall time would count others)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def setup(root: Path, num: int, regions: bool) -> dict:
    """The manifest, the training dataset and the collator of one kind of rows."""
    from vltrain.data.tokenizers import load_tokenizer

    folder = root / ("with" if regions else "without")
    manifest = synthesize(folder, num, 0, seed=0, image_size=96, workers=1, with_regions=regions)["train"]
    tok = load_tokenizer(str(write_tokenizer(root / "without")))  # the same tokenizer for both
    data = DataConfig(train=str(manifest), image_size=64, max_text_length=32, num_workers=0)
    return {"folder": folder, "manifest": manifest, "ds": build_dataset(data, "train", tok),
            "collate": Collator.for_data(tok.pad_id, data)}


def once(kind: dict, num: int, batch: int) -> dict[str, float]:
    """One round of the three timings of one kind of rows, per unit."""
    ds, rows = kind["ds"], min(len(kind["ds"]), 1000)
    samples = [ds[i] for i in range(batch)]
    shutil.rmtree(kind["folder"] / ".vltrain-index", ignore_errors=True)
    return {"load_ms": timed(lambda: [ds[i] for i in range(rows)]) / rows * 1e3,
            "collate_ms": timed(lambda: [kind["collate"](samples) for _ in range(20)]) / 20 * 1e3,
            "index_ms": timed(lambda: open_indexed(str(kind["manifest"]), None, 32, workers=1)) / num * 1e6,
            "regions": sum(len(s.region_ids) for s in samples) / batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=4000, help="rows of the manifest")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    got: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {name: setup(Path(tmp), args.num, name == "with regions")
                 for name in ("without regions", "with regions")}
        for _ in range(args.repeats):  # the kinds take turns, so that a busy moment does not fall on one
            for name, kind in kinds.items():
                m = once(kind, args.num, args.batch)
                got[name] = {k: min(v, got.get(name, m)[k]) for k, v in m.items()}
    print(f"1 thread, CPU time, {args.num} rows, batches of {args.batch}, best of {args.repeats}; {cpu_name()}")
    print("| rows | regions per row | load, ms per sample | collate, ms per batch | index build, ms per 1,000 rows |")
    print("|---|---:|---:|---:|---:|")
    for name, m in got.items():
        print(f"| {name} | {m['regions']:.2f} | {m['load_ms']:.3f} | {m['collate_ms']:.2f} | {m['index_ms']:.1f} |")


if __name__ == "__main__":
    main()
