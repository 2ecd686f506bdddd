"""Sample tables, a table-shaped dataset (no files) and real synthetic datasets for sampler tests."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from vltrain.data.config import DataConfig
from vltrain.data.dataset import ImageTextDataset, Sample, build_dataset
from vltrain.data.ids import stable_uid
from vltrain.data.loading.collate import Collator
from vltrain.data.sources.open import open_source
from vltrain.data.sources.shards import write_shards
from vltrain.data.table import SampleTable
from vltrain.data.tokenizers import load_tokenizer
from vltrain.data.tools.synth import describe, sample_scene, synthesize
from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer


def table(text_len, has_image=None, has_text=None, source=None, patches=None) -> SampleTable:
    text_len = np.asarray(text_len, dtype=np.int32)
    n = len(text_len)
    return SampleTable(
        has_image=np.ones(n, bool) if has_image is None else np.asarray(has_image, bool),
        has_text=(text_len > 0) if has_text is None else np.asarray(has_text, bool),
        text_len=text_len,
        source=np.zeros(n, np.int16) if source is None else np.asarray(source, np.int16),
        patches=None if patches is None else np.asarray(patches, np.int32),
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
    """``ds[i]`` is a :class:`Sample` shaped by the table's row ``i``: text of ``text_len`` tokens, an image or not."""

    def __init__(self, t: SampleTable, image_size: int = 4) -> None:
        self.t, self.image_size = t, image_size

    def __len__(self) -> int:
        return len(self.t)

    def table(self) -> SampleTable:
        return self.t

    def __getitem__(self, i: int) -> Sample:
        n = int(self.t.text_len[i])
        # Drawn from the global generator so tests can see per-sample seeding at work.
        noise = int(float(torch.rand(())) * 255)
        size = self.image_size
        image = torch.full((3, size, size), noise, dtype=torch.uint8) if self.t.has_image[i] else None
        return Sample(uid(i), f"row-{i}", image, [5 + (i + k) % 50 for k in range(n)], False, int(self.t.source[i]))

collate = Collator(pad_id=0, max_text_length=1 << 16, images=4)
"""Pads text to the longest row rounded up to a multiple of 8 (the Collator's default)."""

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
    ds = build_dataset(data_cfg, "train", tok, plan_aware=True)
    return ds, Collator(tok.pad_id, data_cfg.max_text_length, data_cfg.image_size)

def _pattern(folder: Path) -> str:
    tars = sorted(p.stem for p in folder.glob("*.tar"))
    return str(folder / f"{{{tars[0]}..{tars[-1]}}}.tar")
