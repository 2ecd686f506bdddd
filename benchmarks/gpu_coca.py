"""coca-vit-b32 on one GPU: vltrain's training step against OpenCLIP's own CoCa, side by side.

Both train OpenCLIP's coca_ViT-B-32 (the preset is it layer for layer) on the same random pixels
and full-length token ids (76, vocabulary 49,408), bf16 autocast, AdamW:

- vltrain: the trainer's step code (``vltrain.train.step.plain_backward`` over the ``Task``,
  ITC 1 + caption 2, then the optimizer ``build_optimizer`` makes);
- OpenCLIP: ``open_clip.create_model("coca_ViT-B-32")`` with ``open_clip.loss.CoCaLoss``
  (clip 1, caption 2), ``torch.optim.AdamW`` as open_clip_train builds it.

Each side runs ``--warmup`` steps, then ``--steps`` timed, synchronized; peak memory is each side's
own. First, on the same GPU in fp32, the small random CoCa of tests/model/interop/fixtures is
opened by both (vltrain's ``model.init`` path, open_clip's ``local-dir:``) and their features and
caption logits are compared.

Needs open_clip (and ftfy, which it imports) beside torch with CUDA; on a CPU ``--device cpu
--tiny`` is a smoke run of the same code with no figures.

    PYTHONPATH=src python benchmarks/gpu_coca.py [--batch 128] [--steps 10]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vltrain.config.job import load_config
from vltrain.demo import random_pairs
from vltrain.model.builder import build_model
from vltrain.model.config import ModelConfig
from vltrain.checkpoint.paths import locate
from vltrain.model.interop.pretrained import describe, load_pretrained
from vltrain.runtime.precision import Precision
from vltrain.compose.builders import build_task
from vltrain.train.optim import build_optimizer
from vltrain.train.step import plain_backward
from vltrain.types import ModelInputs

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "model" / "interop" / "fixtures" / "openclip-coca"
VOCAB, CONTEXT = 49408, 76


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@torch.no_grad()
def parity(device: torch.device) -> dict[str, float]:
    """Max differences of vltrain's outputs from open_clip's on the fixture CoCa, fp32, on ``device``."""
    import open_clip
    from safetensors.torch import load_file

    # full fp32: cuDNN's default lets open_clip's patch convolution run in TF32 (1e-4 off)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, False
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    theirs, _ = open_clip.create_model_from_pretrained(f"local-dir:{FIXTURE}", device=device)
    source = describe(FIXTURE, locate(FIXTURE).kind)
    ours = build_model(ModelConfig(preset="", arch=source.arch.to_dict()), vocab_size=300, pad_id=0, mask_id=None,
                       image_size=32, max_text_length=source.arch.text.max_length)
    load_pretrained(ours, source)
    ours = ours.to(device).eval()
    pixels, ids = ref["pixels"].to(device), ref["ids"].to(device)
    mask = (ids != 0).long()
    out = theirs.eval()(pixels, ids)
    tokens, pooled = ours.vision(pixels)
    text_tokens, text_pooled = ours.text(ids, mask)
    logits = ours.caption_logits(text_tokens[:, :-1], mask[:, :-1], tokens, torch.ones(len(ids), dtype=torch.bool,
                                                                                          device=device))
    real = mask[:, :-1].bool()
    torch.backends.cudnn.allow_tf32 = True  # torch's default again, for the timed steps
    return {"image features": (F.normalize(ours.image_proj(pooled), dim=-1) - out["image_features"]).abs().max().item(),
            "text features": (F.normalize(ours.text_proj(text_pooled), dim=-1) - out["text_features"]).abs().max().item(),
            "caption logits": (logits - out["logits"])[real].abs().max().item()}


def timed(step, warmup: int, steps: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return time.perf_counter() - start


def vltrain_rate(args, device: torch.device) -> tuple[float, float]:
    preset = "tiny-coca" if args.tiny else "coca-vit-b32"
    cfg = load_config(None, [f"model.preset={preset}", "model.loss.caption=2", f"data.batch_size={args.batch}",
                             f"data.image_size={args.image}", f"data.max_text_length={args.context}",
                             f"train.precision={args.precision}", f"train.device={device.type}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=args.vocab, pad_id=0, mask_id=None, image_size=args.image,
                        max_text_length=args.context).to(device)
    task, optimizer = build_task(cfg, model), build_optimizer(model, cfg.train)
    precision = Precision(args.precision, device)
    pairs = random_pairs(args.batch, args.image, args.context, args.vocab)
    inputs = ModelInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(pairs).items()
                            if k != "images"}, images=pairs.images.map(lambda t: t.to(device)))

    def step():
        optimizer.zero_grad(set_to_none=True)
        plain_backward(task, [inputs], precision.autocast, backward=lambda loss: loss.backward())
        optimizer.step()

    seconds = timed(step, args.warmup, args.steps, device)
    return args.steps * args.batch / seconds, peak_gb(device)


def openclip_rate(args, device: torch.device) -> tuple[float, float]:
    import open_clip
    from open_clip.loss import CoCaLoss

    torch.manual_seed(0)
    if args.tiny:
        model = open_clip.create_model("coca_ViT-B-32", device=device, force_image_size=args.image)
    else:
        model = open_clip.create_model("coca_ViT-B-32", device=device)
    model.train()
    loss_fn = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "bn" not in n and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "bn" not in n and "ln" not in n)]
    optimizer = torch.optim.AdamW([{"params": rest, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.2}],
                                  lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.image, args.image, generator=g).to(device)
    texts = torch.randint(5, args.vocab, (args.batch, args.context), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            out = model(images, texts)
            losses = loss_fn(**out, output_dict=True)
        sum(losses.values()).backward()
        optimizer.step()

    seconds = timed(step, args.warmup, args.steps, device)
    return args.steps * args.batch / seconds, peak_gb(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tiny", action="store_true", help="a smoke run on a CPU: tiny-coca against open_clip at 64 px")
    args = p.parse_args()
    args.image, args.context, args.vocab = (64, 16, 1000) if args.tiny else (224, CONTEXT, VOCAB)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}\n")
    print("open_clip's small CoCa (fixture) opened by both, fp32, max |vltrain - open_clip|:")
    for key, value in parity(device).items():
        print(f"  {key}: {value:.1e}")
    release(device)
    rows = []
    for label, fn in (("vltrain, trainer step", vltrain_rate), ("OpenCLIP CoCa + CoCaLoss", openclip_rate)):
        rate, peak = fn(args, device)
        rows.append((label, rate, peak))
        release(device)
    print(f"\nbatch {args.batch}, {args.image} px, {args.context} tokens, vocabulary {args.vocab}, {args.precision}, "
          f"{args.steps} steps after {args.warmup}")
    print("| stack | samples/s | peak memory (GiB) |\n|---|---:|---:|")
    for label, rate, peak in rows:
        print(f"| {label} | {rate:,.1f} | {peak:.1f} |")
    print(f"\nvltrain / OpenCLIP: {rows[0][1] / rows[1][1]:.2f}x samples/s")


if __name__ == "__main__":
    main()
