"""Sample tables, a table-shaped dataset (no files) and real synthetic datasets for sampler tests."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from vltrain.data.batch import Batch
from vltrain.data.collate import Collator
from vltrain.data.config import DataConfig
from vltrain.data.dataset import ImageTextDataset, build_dataset
from vltrain.data.ids import stable_uid
from vltrain.data.shards import write_shards
from vltrain.data.open import open_source
from vltrain.data.synth import describe, sample_scene, synthesize
from vltrain.data.table import SampleTable
from vltrain.data.text import load_tokenizer, source_texts, train_tokenizer

def table(text_len, has_image=None, has_text=None, source=None) -> SampleTable:
    text_len = np.asarray(text_len, dtype=np.int32)
    n = len(text_len)
    return SampleTable(
        has_image=np.ones(n, bool) if has_image is None else np.asarray(has_image, bool),
        has_text=(text_len > 0) if has_text is None else np.asarray(has_text, bool),
        text_len=text_len,
        source=np.zeros(n, np.int16) if source is None else np.asarray(source, np.int16),
    )

def shapes_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Token counts of synthetic shapes captions: words and commas plus two special tokens."""
    out = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        text = describe(sample_scene(rng), rng)
        out.append(len(text.split()) + text.count(",") + 2)
    return np.asarray(out, dtype=np.int32)

def uid(i: int) -> int:
    return stable_uid(f"row-{i}")

class TableDataset(torch.utils.data.Dataset):
    """``ds[i]`` is a sample shaped by the table's row ``i``: text of ``text_len`` tokens, an image or not."""

    def __init__(self, t: SampleTable, image_size: int = 4) -> None:
        self.t, self.image_size = t, image_size

    def __len__(self) -> int:
        return len(self.t)

    def table(self) -> SampleTable:
        return self.t

    def __getitem__(self, i: int) -> dict:
        n = int(self.t.text_len[i])
        return {
            "id": uid(i),
            "has_image": bool(self.t.has_image[i]),
            "has_text": bool(self.t.has_text[i]),
            "tokens": [5 + (i + k) % 50 for k in range(n)],
            # Drawn from the global generator so tests can see per-sample seeding at work.
            "noise": float(torch.rand(())),
            "source": int(self.t.source[i]),
        }

def collate(samples: list[dict], image_size: int = 4) -> Batch:
    """Pads text to the longest row rounded up to a multiple of 8, as the real collator does."""
    b = len(samples)
    longest = max(max(len(s["tokens"]) for s in samples), 1)
    width = -(-longest // 8) * 8
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : len(s["tokens"])] = torch.tensor(s["tokens"], dtype=torch.long)
        mask[r, : len(s["tokens"])] = 1
    has_image = torch.tensor([s["has_image"] for s in samples])
    pixels = torch.zeros(b, 3, image_size, image_size, dtype=torch.uint8)
    for r, s in enumerate(samples):
        if s["has_image"]:
            pixels[r] = int(s["noise"] * 255)
    return Batch(
        ids=torch.tensor([s["id"] for s in samples], dtype=torch.long),
        pixel_values=pixels,
        has_image=has_image,
        has_text=torch.tensor([s["has_text"] for s in samples]),
        input_ids=ids,
        attention_mask=mask,
        source=torch.tensor([s["source"] for s in samples], dtype=torch.long),
    )

def fork_workers() -> None:
    """Ranks started by torchrun fork their DataLoader workers; spawned test ranks do the same."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)

def synth_files(folder: Path, num: int, *, text_only_fraction: float = 0.0, shards: bool = False,
                **cfg) -> tuple[DataConfig, set[int]]:
    """A synthetic shapes set as a manifest or as tar shards, with a tokenizer: its config and uids."""
    manifest = str(synthesize(folder, num, 2, text_only_fraction=text_only_fraction, seed=0, image_size=16,
                              workers=1)["train"])
    tok = folder / "tok.json"
    train_tokenizer(source_texts([manifest]), tok, vocab_size=200, kind="wordpiece", min_frequency=1)
    train = manifest
    if shards:
        write_shards(open_source(manifest), folder / "shards", shard_size=max(1, num // 3))
        train = _pattern(folder / "shards")
    data_cfg = replace(DataConfig(train=train, tokenizer=str(tok), image_size=16, max_text_length=64,
                                  pin_memory=False), **cfg)
    uids = {stable_uid(str(json.loads(line)["id"])) for line in open(manifest)}
    return data_cfg, uids

def open_data(data_cfg: DataConfig) -> tuple[ImageTextDataset, Collator]:
    tok = load_tokenizer(data_cfg.tokenizer)
    ds = build_dataset(data_cfg, "train", tok)
    return ds, Collator(tok.pad_id, data_cfg.max_text_length, data_cfg.image_size)

def _pattern(folder: Path) -> str:
    tars = sorted(p.stem for p in folder.glob("*.tar"))
    return str(folder / f"{{{tars[0]}..{tars[-1]}}}.tar")
