"""What the losses send between ranks per step, and the memory they take, as the world grows.

Real gloo ranks on this machine run the objectives of ``clip-vit-b16`` (ITC) and ``albef-base``
(ITC + ITM; the fusion encoder included) on encoder outputs of the models' real shapes (random
values: bytes and memory depend on shapes only), with captions padded to 77 tokens on rank 0
and 60 on rank 1. Three ways of exchanging:

- before: the gathers' backward all-reduces the whole gathered gradient; ITM negatives global
  (every rank's token features gathered with gradient); ITC by gathering;
- after: the backward reduce-scatters (each rank receives its own rows' sum); ITM negatives local
  (the default); ITC by gathering (the default);
- ring: as after, with ``model.loss.contrastive_impl: ring``.

Bytes: what the collective recorder (``vltrain.runtime.spmd``) counts for every collective vltrain
issued, by the ring-algorithm cost of each operation (all-gather (W-1) x n, all-reduce
2 (W-1)/W x n, reduce-scatter (W-1)/W x n, a ring pass n), checked against the loopback
interface's transmitted bytes (both ranks' traffic, halved) and against the closed formula below,
which then gives W = 8, 64 and 1,024. DDP's gradient all-reduce (2 (W-1)/W x the parameters'
bytes) is the same in every variant and is listed apart.

Memory: the peak bytes of tensors alive from the encoder outputs to the end of the backward
through the objectives (a dispatch-level tracker), at W = 2 and 4; a line through the two gives
larger W (the gathering loss grows with W, the ring's stays flat).

    PYTHONPATH=src python benchmarks/comm_cost.py [--batch 4] [--mem-batch 256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

VARIANTS = {  # name: (reduce-scatter backward, ITM negatives, contrastive implementation)
    "before": (False, "global", "gather"),
    "after": (True, "local", "gather"),
    "ring": (True, "local", "ring"),
}
MODELS = {"clip-vit-b16": ["model.loss.itm=0"], "albef-base": ["model.loss.itm=1"]}
WIDTHS = (77, 60)  # rank 0 and rank 1 pad their captions to different widths
FLOAT = 4


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive, and their peak, for everything run inside."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self.seen:
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out


def loopback_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])
    return 0


def _model(name: str, variant: str):
    from vltrain.config.job import load_config
    from vltrain.model import build_model
    from vltrain.compose.builders import build_task

    _, negatives, impl = VARIANTS[variant]
    cfg = load_config(None, [f"model.preset={name}", *MODELS[name], f"model.loss.itm_negatives={negatives}",
                             f"model.loss.contrastive_impl={impl}", "data.max_text_length=77", "data.image_size=224"])
    torch.manual_seed(0)
    return build_task(cfg, build_model(cfg.model, vocab_size=49408, pad_id=0, mask_id=4, image_size=224,
                                       max_text_length=77))


def _encoded(model, b: int, width: int, rank: int):
    """Encoder outputs of the model's shapes, as leaves: the loss is all that runs on them."""
    from vltrain.images import Images
    from vltrain.types import Encoded, ModelInputs

    g = torch.Generator().manual_seed(rank)
    fusion = model.fusion is not None
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(True)  # noqa: E731
    vision_tokens = model.vision.num_tokens
    enc = Encoded(
        image_embeds=torch.nn.functional.normalize(leaf(b, model.embed_dim), dim=1),
        text_embeds=torch.nn.functional.normalize(leaf(b, model.embed_dim), dim=1),
        image_tokens=leaf(b, vision_tokens, model.vision.width) if fusion else None,
        text_tokens=leaf(b, width, model.text.width) if fusion else None,
        anchor=torch.zeros(()),
    )
    ones = torch.ones(b, dtype=torch.bool)
    ids = torch.arange(b) + 1000 * rank
    mask = torch.ones(b, width, dtype=torch.long)
    return enc, ModelInputs(Images(torch.zeros(b, 0)), mask, mask, ones, ones.clone(), ids)


def _step(task, b: int, width: int, rank: int) -> tuple[int, float]:
    """One forward + backward of the objectives; returns (peak live bytes, seconds)."""
    import time

    enc, inputs = _encoded(task.model, b, width, rank)
    start = time.perf_counter()
    with LiveBytes() as tracker:
        out = task.objectives.score(task.model, enc, inputs)
        out.loss.backward()
    return tracker.peak, time.perf_counter() - start


def bytes_worker(rank: int, world: int, port: int, b: int, queue) -> None:
    import vltrain.runtime.distributed as d
    from vltrain.runtime.spmd import RECORDER

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for name in MODELS:
        for variant in VARIANTS:
            d.REDUCE_SCATTER = VARIANTS[variant][0]
            model = _model(name, variant)
            dist.barrier()
            RECORDER.reset_counts()
            before = loopback_tx()
            _, seconds = _step(model, b, WIDTHS[rank % 2], rank)
            dist.barrier()
            lo = loopback_tx() - before
            params = sum(p.numel() for p in model.parameters()) * FLOAT
            rows.append({"model": name, "variant": variant, "recorded": dict(RECORDER.bytes_sent), "lo": lo,
                         "params": params, "seconds": seconds, "dims": _dims(model, b)})
    queue.put((rank, rows))
    dist.destroy_process_group()


def memory_worker(rank: int, world: int, port: int, b: int, queue) -> None:
    import vltrain.runtime.distributed as d

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for variant in ("after", "ring"):
        d.REDUCE_SCATTER = True
        model = _model("clip-vit-b16", variant)
        peak, seconds = _step(model, b, WIDTHS[0], rank)
        rows.append({"variant": variant, "peak": peak, "seconds": seconds})
    queue.put((rank, rows))
    dist.destroy_process_group()


def _dims(model, b: int) -> dict[str, int]:
    fusion = model.fusion is not None
    return {"b": b, "D": model.embed_dim, "Nv": model.vision.num_tokens if fusion else 0,
            "Wv": model.vision.width if fusion else 0, "L": max(WIDTHS) if fusion else 0,
            "Wt": model.text.width if fusion else 0}


def formula(variant: str, world: int, b: int, D: int, Nv: int = 0, Wv: int = 0, L: int = 0, Wt: int = 0) -> int:
    """Bytes one rank sends per step for the objectives, by the cost model the recorder uses.

    ITC: a shape exchange (3 tensors x 7 int64; the ring's, 1), ids and validity ([b, 2] int64), the weight total
    (one float all-reduce), both embeddings gathered (2 b D floats); backward: all-reduce (before)
    or reduce-scatter (after) of the gathered [W b, D] gradients. Ring: W-1 passes of both
    embeddings, ids and validity forward; backward the same plus both gradients, and one pass home.
    ITM with global negatives: a shape exchange (6 tensors), image and text tokens with gradient,
    the mask, both embeddings and [b, 3] ids; backward like ITC's for the two token tensors.
    """
    w1 = world - 1
    allreduce = lambda n: 2 * n * w1 // world  # noqa: E731
    reduce_scatter = lambda n: n * w1 // world  # noqa: E731
    shapes = 1 if variant == "ring" else 3  # the ring exchanges only the ids' shape
    total = shapes * 7 * 8 * w1 + 16 * b * w1 + allreduce(FLOAT)
    gathered_grad = world * b * D * FLOAT
    if variant == "ring":
        block = 2 * b * D * FLOAT + 8 * b + b
        total += w1 * block + w1 * (block + 2 * b * D * FLOAT) + 2 * b * D * FLOAT
    else:
        total += 2 * b * D * FLOAT * w1
        total += 2 * (allreduce(gathered_grad) if variant == "before" else reduce_scatter(gathered_grad))
    if Nv and variant == "before":
        image, text = b * Nv * Wv * FLOAT, b * L * Wt * FLOAT
        total += 6 * 7 * 8 * w1 + (image + text + 8 * b * L + 2 * b * D * FLOAT + 24 * b) * w1
        total += allreduce(world * image) + allreduce(world * text)
    return total


def _spawn(fn, world: int, *args) -> list:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def print_bytes(rows: list[list[dict]]) -> None:
    print("\n## Measured on 2 ranks (bytes one rank sends per step, the objectives only)\n")
    print("| model | exchange | recorded (rank 0) | formula | loopback, per rank | ITC + ITM objective time |")
    print("|---|---|---:|---:|---:|---:|")
    for r0, r1 in zip(*rows):
        recorded = sum(r0["recorded"].values())
        per_rank = r0["lo"] / 2
        print(f"| {r0['model']} | {r0['variant']} | {recorded:,} | {formula(r0['variant'], 2, **r0['dims']):,} "
              f"| {per_rank:,.0f} ({per_rank / max(recorded, 1):.2f}x) | {r0['seconds']:.2f} s |")


def print_scale(params: dict[str, int], b_clip: int, b_albef: int) -> None:
    print(f"\n## From the formula: one rank's bytes per step (CLIP b={b_clip}, ALBEF b={b_albef} per rank, fp32)\n")
    print("| model | W | before | after | ring | DDP gradients (every variant) |")
    print("|---|---:|---:|---:|---:|---:|")
    dims = {"clip-vit-b16": dict(b=b_clip, D=512), "albef-base": dict(b=b_albef, D=256, Nv=197, Wv=768, L=35, Wt=768)}
    for name, d in dims.items():
        for world in (2, 8, 64, 1024):
            cells = [human(formula(v, world, **d)) for v in VARIANTS]
            print(f"| {name} | {world:,} | {' | '.join(cells)} | {human(2 * params[name] * (world - 1) / world)} |")


def print_memory(by_world: dict[int, list[dict]], b: int) -> None:
    print(f"\n## Peak memory of ITC's forward + backward (clip-vit-b16, D=512, b={b} per rank)\n")
    print("| exchange | W=2 (measured) | W=4 (measured) | W=64 (line through both) | W=1,024 (line) |")
    print("|---|---:|---:|---:|---:|")
    for i, variant in enumerate(("after", "ring")):
        p2, p4 = by_world[2][0][i]["peak"], by_world[4][0][i]["peak"]
        slope = (p4 - p2) / 2
        label = "gather (before and after)" if variant == "after" else "ring"
        print(f"| {label} | {human(p2)} | {human(p4)} | {human(p2 + slope * 62)} | {human(p2 + slope * 1022)} |")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4, help="rows per rank for the measured bytes")
    p.add_argument("--mem-batch", type=int, default=256, help="rows per rank for the ITC memory")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo on 127.0.0.1")
    rows = _spawn(bytes_worker, 2, args.batch)
    print_bytes(rows)
    params = {r["model"]: r["params"] for r in rows[0]}
    print_scale(params, 256, 64)
    print_memory({w: _spawn(memory_worker, w, args.mem_batch) for w in (2, 4)}, args.mem_batch)


if __name__ == "__main__":
    main()
