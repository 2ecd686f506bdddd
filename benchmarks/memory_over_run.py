"""Resident memory over a long run of the demo config: what the process holds now (not the peak),
split into what the C allocator hands out and what it keeps of freed memory, every few hundred
steps, with ``keep_freed_memory`` (the trainer's default on a CPU) and with glibc's defaults.
Variants: ``keep`` (the trainer as it is); ``default`` (glibc's thresholds); ``trimN`` (``keep``,
and every N steps glibc's ``malloc_trim(0)``, which hands back the freed pages anywhere in the
heaps, called from a thread watching the step count); ``arenasN`` (``keep`` with at most N malloc
arenas, set before anything allocates); ``mmapN`` (``keep``, but blocks of N MiB and more mapped
and unmapped by themselves rather than carved from the heap); ``topN`` (``keep``, but a free top of
the heap beyond N MiB handed back). ``+packN`` after any of them adds
``model.text.pack_multiple=N`` (``keep+pack64``): the text tower's packed token count rounded up
to a multiple of N, so that its sizes repeat.

Each variant trains ``configs/demo.yaml`` (tiny-albef; fp32 on a CPU without bf16 matrix
instructions, as ``vltrain demo`` does) on the demo's shapes data in a process of its own; a
thread samples ``/proc/self/statm`` and glibc's ``mallinfo2`` (all arenas) every second, and the
table prints the sample nearest each reported step; a second table prints the step rate between
reported steps, so that a run that slows as it goes shows.

    PYTHONPATH=src python benchmarks/memory_over_run.py --data data/shapes [--steps 1000] [--every 100]
        [--variants keep,default] [--nproc 2] [--native] [--set KEY=VALUE ...]

``--nproc 2`` runs each variant on 2 ranks under torchrun (one thread each) and prints each rank's
column; ``--native`` trains on copies of the images at five aspect ratios (3:1 to 1:3, written once
beside the data) with ``data.resize: native`` within 9 patches, so the image side's shapes vary from
batch to batch too. ``--set KEY=VALUE`` (repeatable) adds a config override to every variant.

``--data`` is a folder ``vltrain demo`` wrote (train.jsonl, tokenizer.json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
GLIBC_DEFAULT = 128 * 1024
"""glibc's initial trim and mmap thresholds (it raises them as it goes; here they stay put)."""


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


NATIVE_SIZES = ((144, 48), (96, 48), (48, 48), (48, 96), (48, 144))
"""The ``--native`` copies' sizes (width, height), in turn."""


def native_data(data: Path) -> Path:
    """``data``'s training rows with each image resized to one of NATIVE_SIZES (written once)."""
    from PIL import Image

    out = data / "native.jsonl"
    if not out.exists():
        (data / "native").mkdir(exist_ok=True)
        rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
        for i, row in enumerate(rows):
            if "image" in row:
                image = Image.open(data / row["image"]).resize(NATIVE_SIZES[i % len(NATIVE_SIZES)],
                                                               Image.Resampling.BICUBIC)
                row["image"] = f"native/{i}.png"
                image.save(data / row["image"])
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def split_variant(variant: str) -> tuple[str, list[str]]:
    """(the allocator variant, config overrides) of a variant name: ``keep+pack64`` is ``keep`` with
    ``model.text.pack_multiple=64``."""
    base, *mods = variant.split("+")
    overrides = []
    for mod in mods:
        if not (mod.startswith("pack") and mod[len("pack"):].isdigit()):
            raise SystemExit(f"--variants: {variant!r}: after a + comes packN (model.text.pack_multiple=N)")
        overrides.append(f"model.text.pack_multiple={mod[len('pack'):]}")
    return base, overrides


def child(data: Path, steps: int, variant: str, out: Path, native: bool, overrides: list[str]) -> None:
    """One run in this process (one rank of it under torchrun); samples written to ``out`` as JSON
    lines."""
    variant, own = split_variant(variant)
    overrides = [*overrides, *own]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    if variant.startswith("arenas"):  # before torch starts any thread
        libc.mallopt(_M_ARENA_MAX, int(variant[len("arenas"):]))
    from _demo_model import fp32_here  # benchmarks/ is on sys.path
    from vltrain.config.job import load_config
    from vltrain.demo import demo_config_path
    from vltrain.train.trainer import Trainer

    trim_every = int(variant[len("trim"):]) if variant.startswith("trim") else 0
    page = os.sysconf("SC_PAGE_SIZE")
    rank = int(os.environ.get("RANK", "0"))
    run = out.with_name(f"{out.stem}-run")  # one folder for all ranks, in the parent's
    out = out.with_name(f"{out.stem}.rank{rank}.jsonl")
    train = [f"data.train={data / 'native.jsonl'}", "data.resize=native", "data.max_patches=9"] if native \
        else [f"data.train={data / 'train.jsonl'}"]
    cfg = load_config(demo_config_path(), [f"run.dir={run}", *train, "data.val=''",
                                           f"data.tokenizer={data / 'tokenizer.json'}", f"train.max_steps={steps}",
                                           "train.log_every=100000", "eval.every=0", "train.progress=false",
                                           "model.preset=tiny-albef",  # the model of the recorded figures
                                           *fp32_here(), *overrides])
    trainer = Trainer(cfg)  # keep_freed_memory() ran in its set-up
    if variant == "default":
        libc.mallopt(_M_MMAP_THRESHOLD, GLIBC_DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, GLIBC_DEFAULT)
    elif variant.startswith(("mmap", "thp")):
        libc.mallopt(_M_MMAP_THRESHOLD, int(variant.removeprefix("mmap").removeprefix("thp")) << 20)
    elif variant.startswith("top"):
        libc.mallopt(_M_TRIM_THRESHOLD, int(variant[len("top"):]) << 20)
    done = threading.Event()

    def trim() -> None:
        trimmed = 0
        while not done.is_set():
            if trainer.step // trim_every > trimmed:
                trimmed = trainer.step // trim_every
                libc.malloc_trim(0)
            done.wait(0.01)

    if trim_every:
        threading.Thread(target=trim, daemon=True).start()

    def sample() -> None:
        with open(out, "w") as f:
            while not done.is_set():
                m = libc.mallinfo2()
                with open("/proc/self/statm") as statm:
                    rss = int(statm.read().split()[1]) * page
                f.write(json.dumps({"step": trainer.step, "time": time.perf_counter(), "rss": rss,
                                    "in_use": m.uordblks + m.hblkhd, "kept_free": m.fordblks}) + "\n")
                f.flush()
                done.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    trainer.train()
    done.set()
    sampler.join()
    trainer.close()


PRELOADS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}


def variant_env(variant: str) -> dict[str, str]:
    """What a variant sets before its process starts: another allocator preloaded, or glibc's
    transparent huge pages for what it maps (``thpN``: ``mmapN`` with ``glibc.malloc.hugetlb=1``)."""
    if variant in PRELOADS:
        return {"LD_PRELOAD": PRELOADS[variant]}
    if variant.startswith("thp"):
        return {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    return {}


def table(samples: dict[str, list[dict]], every: int) -> None:
    gib = 2**30
    print("| step | " + " | ".join(f"{v}: RSS (most since the last row) / in use / kept free (GiB)"
                                    for v in samples) + " |")
    print("|---:|" + "---:|" * len(samples))
    last = max(s[-1]["step"] for s in samples.values())
    for step in [1, *range(every, last + 1, every)]:
        cells = []
        for rows in samples.values():
            r = min(rows, key=lambda x: abs(x["step"] - step))
            most = max((x["rss"] for x in rows if step - every < x["step"] <= step), default=r["rss"])
            cells.append(f"{r['rss'] / gib:.2f} ({most / gib:.2f}) / {r['in_use'] / gib:.2f} / {r['kept_free'] / gib:.2f}")
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("\n| steps | " + " | ".join(f"{v}: steps/s" for v in samples) + " |")
    print("|---:|" + "---:|" * len(samples))
    bounds = [1, *range(every, last + 1, every)]
    for lo, hi in zip(bounds, bounds[1:]):
        print(f"| {lo}-{hi} | " + " | ".join(f"{rate(rows, lo, hi):.2f}" for rows in samples.values()) + " |")
    for name, rows in samples.items():
        print(f"{name}: {rate(rows, 1, last):.2f} steps/s")


def rate(rows: list[dict], lo: int, hi: int) -> float:
    """Steps per second from the first sample at step ``lo`` or later to the last at ``hi`` or
    earlier (so a run's start-up, at step 0, is left out)."""
    a = next(x for x in rows if x["step"] >= lo)
    b = next(x for x in reversed(rows) if x["step"] <= hi)
    return (b["step"] - a["step"]) / max(b["time"] - a["time"], 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--variants", default="keep,default")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--native", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every variant (data.pad_multiple=32: one text width)")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.data, a.steps, a.child[0], Path(a.child[1]), a.native, a.set)
        return
    if a.native:
        native_data(a.data)
    samples = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in a.variants.split(","):
            out = Path(tmp) / f"{variant}.jsonl"
            env = dict(os.environ, PYTHONPATH=str(REPO / "src"), **variant_env(split_variant(variant)[0]))
            launch = [sys.executable] if a.nproc == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc)]
            subprocess.run([*launch, __file__, "--data", str(a.data), "--steps", str(a.steps),
                            *(["--native"] if a.native else []),
                            *(f"--set={x}" for x in a.set), "--child", variant, str(out)], check=True, env=env)
            for rank in range(a.nproc):
                name = variant if a.nproc == 1 else f"{variant}, rank {rank}"
                lines = out.with_name(f"{out.stem}.rank{rank}.jsonl").read_text().splitlines()
                samples[name] = [json.loads(x) for x in lines]
    table(samples, a.every)


if __name__ == "__main__":
    main()
