"""vltrain's training loader against its peers' input pipelines, on the same files.

Writes ``--num`` photo-like images as img2dataset stores them (shorter side resized to 256, centre
crop 256x256, JPEG quality 95) with captions of 5 to 40 words, in ``--files`` files twice: as
img2dataset tar shards (``KEY.jpg``, ``KEY.txt``, ``KEY.json``) and as Hugging Face Hub parquet
(the ``datasets`` library's Image feature, a ``{bytes, path}`` struct, ``--row-group`` rows per
row group: ``datasets`` writes image sets in row groups of 100). Then one epoch is timed of

  (a) the peer: on the shards, OpenCLIP's training pipeline with the ``webdataset`` library
      (``webdataset_pipeline``); on the parquet files, the ``datasets`` library's own route,
      ``Dataset.from_parquet(...).to_iterable_dataset(num_shards=files)`` shuffled with a buffer
      in a torch DataLoader. 1 worker; per sample Pillow decodes, then OpenCLIP's train
      preprocess written with Pillow and torch (torchvision cannot be imported beside this CPU
      torch): RandomResizedCrop(224, scale=(0.9, 1.0), bicubic) + ToTensor + Normalize; captions
      tokenized with the same tokenizer, padded to 77 (OpenCLIP's context length);
  (b) vltrain's training loader on the same files (``data.train`` their brace pattern), 1
      worker, the same batch size and tokenizer; its batches stay uint8 until the device
      normalizes them (on a GPU, where training puts them);
  (c) the same, with the normalization to (a)'s float output done here on the CPU
      (``Batch.pixels``) and counted.

Each is reported in samples per CPU-second (this process and its loader worker: psutil for the
live worker, ``getrusage(RUSAGE_CHILDREN)`` for reaped ones) and per wall-second, the best of
``--repeats`` epochs, with the ratios (b)/(a) and (c)/(a). ``--half`` runs one table only.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/peer_loader.py [--num 1000] [--repeats 3] [--half both]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from PIL import Image

from vltrain.data.config import DataConfig
from vltrain.data.dataset import build_dataset
from vltrain.data.loading.loader import build_train_loader
from vltrain.data.tools.tokenizer_training import train_tokenizer

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # OpenCLIP's
CONTEXT = 77


def stored_jpeg(rng: np.random.Generator, size: int = 256) -> bytes:
    """A photo-like 500x375 image as img2dataset stores it: shorter side ``size``, centre crop."""
    import io

    from data_pipeline import photo  # benchmarks/ is on sys.path when this script runs

    im = photo(rng)
    scale = size / min(im.size)
    im = im.resize((max(size, round(im.width * scale)), max(size, round(im.height * scale))), Image.Resampling.BICUBIC)
    left, top = (im.width - size) // 2, (im.height - size) // 2
    buf = io.BytesIO()
    im.crop((left, top, left + size, top + size)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def make_pairs(num: int) -> tuple[list[bytes], list[str]]:
    rng = np.random.default_rng(0)
    vocab = [f"{a}{b}" for a in ("red", "tall", "old", "dark", "wet", "big") for b in ("", "dish", "tree", "car", "dog")]
    images = [stored_jpeg(rng) for _ in range(num)]
    return images, [" ".join(rng.choice(vocab, size=int(rng.integers(5, 41)))) for _ in range(num)]


def make_shards(folder: Path, jpegs: list[bytes], texts: list[str], files: int) -> str:
    """img2dataset's tar layout: ``NNNNN.tar`` of ``KEY.jpg``, ``KEY.txt``, ``KEY.json``."""
    import io
    import json
    import tarfile

    (folder / "shards").mkdir(parents=True)
    per = -(-len(jpegs) // files)
    for k in range(files):
        with tarfile.open(folder / "shards" / f"{k:05d}.tar", "w") as tar:
            for i in range(k * per, min(len(jpegs), (k + 1) * per)):
                key = f"{k:05d}{i:04d}"
                for ext, data in (("jpg", jpegs[i]), ("txt", texts[i].encode()),
                                  ("json", json.dumps({"key": key}).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / "shards" / f"{{00000..{files - 1:05d}}}.tar")


def make_parquet(folder: Path, jpegs: list[bytes], texts: list[str], files: int, row_group: int) -> str:
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    images = [{"bytes": b, "path": None} for b in jpegs]
    ds = Dataset.from_dict({"image": images, "text": texts},
                           features=Features({"image": ImageFeature(), "text": Value("string")}))
    (folder / "data").mkdir(parents=True)
    paths = []
    for k in range(files):
        path = folder / "data" / f"train-{k:05d}-of-{files:05d}.parquet"
        ds.shard(num_shards=files, index=k, contiguous=True).to_parquet(str(path), batch_size=row_group)
        paths.append(str(path))
    return str(folder / "data" / f"train-{{00000..{files - 1:05d}}}-of-{files:05d}.parquet")


# -- OpenCLIP's train preprocess, with Pillow and torch ------------------------------------------


def random_resized_crop(im: Image.Image, size: int, rng: random.Random, scale=(0.9, 1.0),
                        ratio=(3 / 4, 4 / 3)) -> Image.Image:
    """torchvision's RandomResizedCrop.get_params (10 tries, then the centre fallback) + bicubic resize."""
    w, h = im.size
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
            return im.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + cw, top + ch))
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return im.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))


class Preprocess:
    """RandomResizedCrop(224, scale=(0.9, 1.0), bicubic) + ToTensor + Normalize, and the tokenizer."""

    def __init__(self, tokenizer_json: str, size: int = 224):
        import tokenizers

        self.size = size
        self.tok = tokenizers.Tokenizer.from_file(tokenizer_json)
        self.tok.enable_truncation(CONTEXT)
        self.tok.enable_padding(length=CONTEXT)
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)
        self.rng = random.Random(0)

    def image(self, im: Image.Image) -> torch.Tensor:
        im = random_resized_crop(im.convert("RGB"), self.size, self.rng)
        x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std

    def text(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok.encode(text).ids)

    def __call__(self, example: dict) -> dict:
        return {"image": self.image(example["image"]), "text": self.text(example["text"])}


def collate(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s["image"] for s in samples]), torch.stack([s["text"] for s in samples])


def datasets_pipeline(paths: list[str], tokenizer_json: str, batch_size: int) -> int:
    from datasets import Dataset

    ds = Dataset.from_parquet(paths).to_iterable_dataset(num_shards=len(paths))
    ds = ds.shuffle(seed=0, buffer_size=1000).map(Preprocess(tokenizer_json), remove_columns=["image"])
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=1, collate_fn=collate)
    n = 0
    for images, _ in loader:
        n += len(images)
    return n


def webdataset_pipeline(pattern: str, tokenizer_json: str, batch_size: int) -> int:
    """OpenCLIP's training input pipeline as ``open_clip_train/data.py`` builds it for one epoch
    (``--dataset-resampled`` off): shard list, split by worker, tar to samples, shuffle(5000),
    decode ``pilrgb``, rename, train preprocess and tokenize, batched, WebLoader."""
    import webdataset as wds

    from vltrain.data.sources.patterns import expand_braces

    pre = Preprocess(tokenizer_json)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(expand_braces(pattern)), wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue), wds.shuffle(5000, initial=1000, rng=random.Random(0)),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=pre.image, text=pre.text), wds.to_tuple("image", "text"),
        wds.batched(batch_size, partial=True),
    )
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=1)
    n = 0
    for images, _ in loader:
        n += len(images)
    return n


def vltrain_pipeline(cfg: DataConfig, tokenizer, normalize: bool) -> int:
    ds = build_dataset(cfg, "train", tokenizer, plan_aware=True)
    ds.table()
    loader = build_train_loader(cfg, ds, rank=0, world_size=1, seed=0, run_dir=None, pad_id=tokenizer.pad_id)
    n = 0
    it = iter(loader)
    for _ in range(len(loader)):
        b = next(it)
        if normalize:
            b.pixels(MEAN, STD)  # the same float output as (a), here on this CPU
        n += len(b)
    return n


# -- timing ----------------------------------------------------------------------------------------


def cpu_seconds(seen: dict[int, float]) -> float:
    """CPU seconds of this process, its reaped children and its live children (each child's latest
    reading is kept in ``seen``, so one that exits later is not lost)."""
    me = psutil.Process()
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            seen[child.pid] = t.user + t.system
        except psutil.Error:
            pass
    own = me.cpu_times()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.user + own.system + reaped.ru_utime + reaped.ru_stime + sum(seen.values())


def timed(run, repeats: int) -> tuple[float, float]:
    """(samples per CPU-second, per wall-second), the best of ``repeats`` epochs."""
    best_cpu = best_wall = 0.0
    for _ in range(repeats):
        seen: dict[int, float] = {}
        c0, t0 = cpu_seconds(seen), time.perf_counter()
        seen.clear()  # children alive before the run count from their reading at the start
        n = run()
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(seen) - c0
        best_cpu, best_wall = max(best_cpu, n / cpu), max(best_wall, n / wall)
    return best_cpu, best_wall


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num", type=int, default=1000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--row-group", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--half", choices=("parquet", "webdataset", "both"), default="both")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        jpegs, texts = make_pairs(args.num)
        tokenizer = train_tokenizer(iter(texts), folder / "tok.json", vocab_size=300, kind="wordpiece",
                                    min_frequency=1)
        print(f"CPU: {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}, {args.num} images "
              f"256x256 JPEG q95 in {args.files} files, batch {args.batch_size}, 1 worker")
        if args.half in ("webdataset", "both"):
            pattern = make_shards(folder, jpegs, texts, args.files)
            table("tar shards (img2dataset layout)", {
                "(a) OpenCLIP's webdataset pipeline": timed(
                    lambda: webdataset_pipeline(pattern, str(folder / "tok.json"), args.batch_size), args.repeats),
                **ours(pattern, tokenizer, args)})
        if args.half in ("parquet", "both"):
            pattern = make_parquet(folder, jpegs, texts, args.files, args.row_group)
            paths = sorted(str(q) for q in (folder / "data").glob("*.parquet"))
            table(f"Hub parquet, row groups of {args.row_group}", {
                "(a) datasets to_iterable_dataset + DataLoader": timed(
                    lambda: datasets_pipeline(paths, str(folder / "tok.json"), args.batch_size), args.repeats),
                **ours(pattern, tokenizer, args)})


def ours(pattern: str, tokenizer, args) -> dict[str, tuple[float, float]]:
    cfg = DataConfig(train=pattern, image_size=224, max_text_length=CONTEXT, batch_size=args.batch_size,
                     num_workers=1, pin_memory=False, mean=MEAN, std=STD)
    return {"(b) vltrain loader (uint8 out, as trained)": timed(lambda: vltrain_pipeline(cfg, tokenizer, False),
                                                                args.repeats),
            "(c) vltrain loader + normalize on this CPU": timed(lambda: vltrain_pipeline(cfg, tokenizer, True),
                                                                args.repeats)}


def table(title: str, rows: dict[str, tuple[float, float]]) -> None:
    print(f"\n{title}\n{'pipeline':<48}{'samples/CPU-s':>15}{'samples/s':>12}")
    for name, (cpu, wall) in rows.items():
        print(f"{name:<48}{cpu:>15.1f}{wall:>12.1f}")
    (a_cpu, a_wall), *rest = rows.values()
    for name, (cpu, wall) in zip("bc", rest):
        print(f"{f'ratio ({name})/(a)':<48}{cpu / a_cpu:>14.2f}x{wall / a_wall:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
