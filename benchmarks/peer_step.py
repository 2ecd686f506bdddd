"""One training step of the same CLIP, vltrain against transformers, side by side.

The architecture is a transformers ``CLIPConfig`` sized for a small CPU: a ViT-S-like image tower
(width 384, 12 layers, 6 heads, patch 16 on 64 x 64 images: 17 tokens) and a text tower of the same
size over 32-token context with CLIP's 49,408-token vocabulary, 256-d embeddings, GELU. It is saved
once as a Hugging Face folder with random weights, and both sides start from it:

- vltrain: the model built through ``model.init`` from that folder, its ``Task`` (ITC) and its AdamW
  (``build_optimizer``), one step as the trainer runs it (``plain_backward``, then ``optimizer.step``),
  with the trainer's allocator setting (``keep_freed_memory``);
- transformers: ``CLIPModel.from_pretrained`` of the same folder, ``model(..., return_loss=True)``,
  ``loss.backward()`` and ``torch.optim.AdamW(model.parameters())``, as its users write it.

The same batch (random pixels, token ids of 8-32 tokens padded to the longest), the same threads,
under bf16 autocast and in fp32; neither side clips gradients. Each row runs in its own process
(peak memory is that process's: on a CPU its peak RSS, weights, optimizer state and activations plus
torch itself; on a GPU torch's peak allocation). On a CPU without bf16 matrix instructions (AVX2
only) bf16 matmuls are emulated, so bf16 is slower than fp32 on both sides; the ratio is what
compares. Target: vltrain >= 1.3x transformers in samples/s.

Optional rows: ``--padded`` (vltrain's text tower over the batch padded to its longest caption, as
transformers runs it: ``model.text.layout=padded``), ``--matmul-attention`` (CPU bf16: attention
as two plain matmuls) and ``--compiled`` (``train.compile=true``). ``--device cuda`` runs on a GPU
(fp32 matmuls may use TF32 there, on both sides).

    PYTHONPATH=src python benchmarks/peer_step.py [--batch 32] [--steps 5] [--threads 2] [--repeats 2]
        [--precisions bf16 fp32] [--device cpu|cuda] [--padded] [--matmul-attention] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

WIDTH, LAYERS, HEADS, IMAGE, PATCH, CONTEXT, VOCAB, EMBED = 384, 12, 6, 64, 16, 32, 49408, 256


def save_folder(folder: Path) -> None:
    """The random CLIPModel, its tokenizer.json and preprocessor config, as a user would have them."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tower = dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 hidden_act="gelu")
    config = transformers.CLIPConfig(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": CONTEXT, "bos_token_id": VOCAB - 2,
                     "eos_token_id": VOCAB - 1, "pad_token_id": VOCAB - 1},
        vision_config={**tower, "image_size": IMAGE, "patch_size": PATCH}, projection_dim=EMBED)
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<|startoftext|>": VOCAB - 2, "<|endoftext|>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", VOCAB - 2), ("<|endoftext|>", VOCAB - 1)])
    tok.save(str(folder / "tokenizer.json"))
    transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}
                                    ).save_pretrained(folder)


def batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, CONTEXT + 1, (n,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(1, VOCAB - 2, (n, width), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, VOCAB - 1)
    ids[:, 0] = VOCAB - 2
    ids[torch.arange(n), lengths - 1] = VOCAB - 1
    return {"pixels": torch.randn(n, 3, IMAGE, IMAGE, generator=g), "input_ids": ids, "attention_mask": mask}


VARIANTS = {
    "vltrain": (),
    "vltrain-padded": ("model.text.layout=padded",),  # the text tower over the batch padded to its longest
    "vltrain-compiled": ("train.compile=true",),  # each tower whole through torch.compile (GPU rows)
}


def vltrain_step(folder: Path, precision: str, b: dict, device: torch.device, overrides: tuple[str, ...]):
    from vltrain.config.job import load_config
    from vltrain.runtime.precision import Precision
    from vltrain.runtime.world import keep_freed_memory
    from vltrain.compose.builders import build_task
    from vltrain.compose.decide import decide
    from vltrain.compose.opening import open_model
    from vltrain.train.optim import build_optimizer
    from vltrain.train.parallelize import compile_towers
    from vltrain.train.step import plain_backward
    from vltrain.images import Images
    from vltrain.types import ModelInputs

    keep_freed_memory()
    cfg = load_config(None, [f"model.init={folder}", f"train.precision={precision}", "train.lr=1e-5", *overrides])
    decided = decide(cfg)
    cfg, model = decided.cfg, open_model(decided, device=device).model
    if cfg.train.compile:
        compile_towers(model)
    task, optimizer = build_task(cfg, model), build_optimizer(model, cfg.train)
    autocast = Precision(precision, device).autocast
    n = b["pixels"].shape[0]
    inputs = ModelInputs(images=Images(b["pixels"]), input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         has_image=torch.ones(n, dtype=torch.bool, device=device),
                         has_text=torch.ones(n, dtype=torch.bool, device=device), ids=torch.arange(n, device=device))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = plain_backward(task, [inputs], autocast, backward=lambda x: x.backward()).loss
        optimizer.step()
        return float(loss)

    return step


def transformers_step(folder: Path, precision: str, b: dict, device: torch.device):
    import transformers

    model = transformers.CLIPModel.from_pretrained(folder).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixels"],
                        return_loss=True)
        out.loss.backward()
        optimizer.step()
        return float(out.loss.detach())

    return step


def child(impl: str, precision: str, folder: Path, n: int, steps: int, threads: int, device: str) -> dict:
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":  # the same matmul precision on both sides (vltrain's trainer sets TF32 by default)
        torch.set_float32_matmul_precision("high")
    b = {k: v.to(dev) for k, v in batch(n).items()}
    if impl == "vltrain-matmul":  # bf16 attention as two plain matmuls, whatever the CPU
        import vltrain.model.blocks as blocks

        blocks.cpu_multiplies_bf16 = lambda: True
    if impl == "transformers":
        step = transformers_step(folder, precision, b, dev)
    else:
        step = vltrain_step(folder, precision, b, dev, VARIANTS.get(impl, ()))
    first = step()
    for _ in range(3 if impl == "vltrain-compiled" else 1):  # warm-up (compilation)
        step()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    if dev.type == "cuda":
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"impl": impl, "precision": precision, "samples_s": n / seconds, "ms": 1000 * seconds, "peak_mib": peak_mib,
            "first_loss": first}


def run_child(impl: str, precision: str, folder: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, precision, str(folder), "--batch", str(args.batch),
           "--steps", str(args.steps), "--threads", str(args.threads), "--device", args.device]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{impl} {precision} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def impls(args, precision: str) -> list[str]:
    """The rows of one precision, transformers last."""
    rows = ["vltrain"]
    if args.padded:
        rows.append("vltrain-padded")
    if args.matmul_attention and precision == "bf16" and args.device == "cpu":
        rows.append("vltrain-matmul")
    if args.compiled:
        rows.append("vltrain-compiled")
    return rows + ["transformers"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--repeats", type=int, default=2, help="runs of each row, interleaved; the best is kept")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--padded", action="store_true",
                   help="one more row: vltrain's text tower over the batch padded to its longest caption "
                        "(model.text.layout=padded), as transformers runs it")
    p.add_argument("--matmul-attention", action="store_true",
                   help="one more bf16 row on CPU: vltrain with its plain-matmul attention (the path for CPUs with "
                        "bf16 instructions) on this CPU")
    p.add_argument("--compiled", action="store_true", help="one more row: vltrain with train.compile=true")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "PRECISION", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        impl, precision, folder = args.child
        print(json.dumps(child(impl, precision, Path(folder), args.batch, args.steps, args.threads, args.device)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "clip"
        save_folder(folder)
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.repeats):
            for precision in args.precisions:
                for impl in impls(args, precision):
                    r = run_child(impl, precision, folder, args)
                    key = (impl, precision)
                    if key not in best or r["samples_s"] > best[key]["samples_s"]:
                        best[key] = r
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} CPU threads"
    memory = "peak GPU MiB" if args.device == "cuda" else "peak RSS MiB"
    print(f"CLIP ViT-S-like ({WIDTH}w x {LAYERS}, patch {PATCH} at {IMAGE} px; text {WIDTH}w x {LAYERS}, "
          f"context {CONTEXT}, vocab {VOCAB}), batch {args.batch}, {where}, best of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'precision':<10}{'implementation':<18}{'samples/s':>10}{'ms/step':>10}{memory:>14}{'first loss':>12}"
          f"{'vltrain/transformers':>22}")
    for precision in args.precisions:
        peer = best[("transformers", precision)]["samples_s"]
        for impl in impls(args, precision):
            r = best[(impl, precision)]
            ratio = "" if impl == "transformers" else f"{r['samples_s'] / peer:.2f}x"
            print(f"{precision:<10}{impl:<18}{r['samples_s']:>10.2f}{r['ms']:>10.1f}{r['peak_mib']:>14.0f}"
                  f"{r['first_loss']:>12.4f}{ratio:>22}")


if __name__ == "__main__":
    main()
