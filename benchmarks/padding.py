"""Padding waste and training throughput: fixed batches vs pad-to-512 vs budget batching.

Writes a manifest whose caption lengths are long-tailed (log-normal word counts, most captions
short, a few hundred tokens long), builds the sample table from it, and for each batching mode
reports over one epoch the padding ratio (text positions computed / real tokens) and samples per
second of forward+backward of a small text transformer (1 thread) over the whole epoch. Pad-to-512
batches all have the same shape, so their rate is timed on the first ``--timed-batches`` only.

    PYTHONPATH=src python benchmarks/padding.py [--rows 3000] [--timed-batches 8]

Token counts are words + 2 special tokens (a whitespace tokenizer), capped at 512. Widths are
rounded as ``data.pad_multiple`` does by default (8 for fixed batches, none for budget batches);
budget batching with rounding to 8 is shown too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vltrain.data.config import DataConfig, padded_width
from vltrain.data.schedule.budget import batch_tokens
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.data.table import SampleTable

MAX_LEN = 512
WORDS = "a an the red blue green small large circle square star on at in top left right of with and".split()


def write_manifest(path: Path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = np.clip(rng.lognormal(mean=3.0, sigma=0.8, size=rows).astype(int), 3, MAX_LEN - 2)
    with path.open("w") as f:
        for i, n in enumerate(words):
            text = " ".join(rng.choice(WORDS, size=n))
            f.write(json.dumps({"id": f"r{i}", "image": f"images/{i}.png", "text": text}) + "\n")


def read_table(path: Path) -> SampleTable:
    lens = [min(len(json.loads(line)["text"].split()) + 2, MAX_LEN) for line in path.open()]
    n = len(lens)
    return SampleTable(np.ones(n, bool), np.ones(n, bool), np.asarray(lens, np.int32), np.zeros(n, np.int16))


class TextTower(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, width)
        layer = torch.nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(ids), src_key_padding_mask=mask == 0).mean()


def make_batch(lens: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.arange(width)[None, :] < torch.as_tensor(lens)[:, None]).long()
    return torch.randint(1, 1000, (len(lens), width)) * mask, mask


def measure(name: str, batches: list[np.ndarray], table: SampleTable, widths: list[int],
            timed: int | None = None) -> dict:
    real = int(sum(table.text_len[b].sum() for b in batches))
    positions = sum(len(b) * w for b, w in zip(batches, widths))
    torch.manual_seed(0)
    model = TextTower()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rows = 0
    start = time.perf_counter()
    for b, w in list(zip(batches, widths))[:timed]:
        ids, mask = make_batch(table.text_len[b], w)
        loss = model(ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rows += len(b)
    secs = time.perf_counter() - start
    return {"mode": name, "batches": len(batches), "mean_rows": np.mean([len(b) for b in batches]),
            "ratio": positions / real, "samples_s": rows / secs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timed-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "train.jsonl"
        write_manifest(manifest, args.rows, args.seed)
        table = read_table(manifest)
    lens = table.text_len
    print(f"{len(lens)} captions, tokens: median {int(np.median(lens))}, p90 {int(np.percentile(lens, 90))}, "
          f"p99 {int(np.percentile(lens, 99))}, max {int(lens.max())}")
    floor = sum(padded_width(int(x)) for x in lens) / lens.sum()
    print(f"floor: every row padded alone to a multiple of 8 computes {floor:.3f} positions per token")
    bs = args.batch_size
    common = dict(seed=args.seed)
    fixed = list(DistributedBatchSampler(table, Schedule(batch_size=bs, **common), rank=0, world_size=1))
    fixed = [np.asarray(b) for b in fixed]
    # Budget: the positions of a fixed batch of median-length rows (x4 headroom), up to 8x the rows.
    token_budget = max(bs * 4 * int(np.median(lens)), MAX_LEN)
    m_fixed = DataConfig(batching="fixed").resolve().pad_multiple
    results = [
        measure(f"fixed, pad to longest (multiple of {m_fixed})", fixed, table,
                [batch_tokens(lens[b], m_fixed) // len(b) for b in fixed]),
        measure("fixed, pad to 512", fixed, table, [MAX_LEN] * len(fixed), args.timed_batches),
    ]
    for multiple in (DataConfig(batching="budget").resolve().pad_multiple, 8):
        schedule = Schedule(batch_size=8 * bs, batching="budget", token_budget=token_budget, image_budget=8 * bs,
                            pad_multiple=multiple, **common)
        budget = [np.asarray(b) for b in DistributedBatchSampler(table, schedule, rank=0, world_size=1)]
        results.append(measure(f"budget ({token_budget} positions, multiple of {multiple})", budget, table,
                               [batch_tokens(lens[b], multiple) // len(b) for b in budget]))
    print("\n| batching | batches/epoch | mean rows | padding ratio | samples/s |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['batches']} | {r['mean_rows']:.1f} | {r['ratio']:.2f} | {r['samples_s']:.0f} |")


if __name__ == "__main__":
    main()
