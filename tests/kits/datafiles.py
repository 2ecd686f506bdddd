"""Small real files for data tests: images made with Pillow, manifests, a tiny tokenizer."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image

from vltrain.data.tokenizers import Tokenizer
from vltrain.data.tools.tokenizer_training import train_tokenizer

WORDS = "a an the red green blue small large circle square triangle left right of above below".split()


def distinct_image(i: int, size: tuple[int, int] = (20, 14)) -> Image.Image:
    """An RGB image whose pixels encode ``i``, so that two rows never decode alike."""
    a = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    a[..., 0] = i % 251
    a[..., 1] = (i // 251) % 251
    a[..., 2] = np.linspace(0, 255, size[0], dtype=np.uint8)[None, :]
    return Image.fromarray(a, "RGB")


def save(im: Image.Image, path: Path, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, **kw)
    return path


def write_jsonl(path: Path, rows: list[dict | str | bytes]) -> Path:
    """Rows are dicts (dumped as JSON), or raw lines (str/bytes) for malformed-line tests."""
    with open(path, "wb") as f:
        for r in rows:
            if isinstance(r, dict):
                r = json.dumps(r)
            f.write((r.encode("utf-8") if isinstance(r, str) else r) + b"\n")
    return path


def write_csv(path: Path, header: list[str], rows: list[list], sep: str = ",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=sep)
        w.writerow(header)
        w.writerows(rows)
    return path


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def tiny_tokenizer(folder: Path, kind: str = "wordpiece") -> Tokenizer:
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    return train_tokenizer(texts, folder / f"tok-{kind}.json", vocab_size=120, kind=kind, min_frequency=1)


def caption(i: int, n_words: int = 4) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n_words)) + f" {i}"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``vltrain ARGS`` in this process (the cwd is the caller's); exit code, stdout, stderr. The
    command sets torch's thread count for itself (``setup_world``); it is put back, so that the
    tests after it in this process run at the suite's one thread."""
    import torch

    from vltrain.cli.main import main

    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        code = main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return code, out, err
