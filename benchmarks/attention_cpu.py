"""Attention forward + backward on CPU in bf16, at the demo model's shapes: ours vs PyTorch's kernels.

``vltrain.model.blocks.attention`` sends CPU bf16/fp16 attention through two plain matmuls and a
softmax in the input dtype; this compares it with what ``F.scaled_dot_product_attention`` runs
(the CPU flash kernel, which SDPA picks by default, and the math fallback), all on bf16 inputs, and
prints the largest deviation of each from an fp32 reference.

    PYTHONPATH=src python benchmarks/attention_cpu.py [--batch 256] [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vltrain.model.blocks import attention, key_padding_mask  # noqa: E402
from vltrain.runtime.world import keep_freed_memory  # noqa: E402


def sdpa(backend: SDPBackend):
    def run(q, k, v, mask):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


KERNELS = {"vltrain (matmul + softmax)": attention, "SDPA flash (default)": sdpa(SDPBackend.FLASH_ATTENTION),
           "SDPA math": sdpa(SDPBackend.MATH)}


def time_kernel(fn, q, k, v, mask, grad, repeats: int) -> float:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def once():
        fn(*leaves, mask).backward(grad)

    for _ in range(3):
        once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    g = torch.Generator().manual_seed(0)
    heads, head_dim = 4, 32
    print(f"bf16 forward + backward, batch {args.batch}, {heads} heads of {head_dim}, {args.threads} threads")
    print("| shape | kernel | ms | vs vltrain | max abs error vs fp32 |")
    print("|---|---|---:|---:|---:|")
    for name, length, masked in (("text: 32 tokens, padding mask", 32, True), ("image: 10 tokens, no mask", 10, False)):
        q, k, v = (torch.randn(args.batch, heads, length, head_dim, generator=g) for _ in range(3))
        lengths = torch.randint(4, length + 1, (args.batch,), generator=g)
        mask = key_padding_mask((torch.arange(length)[None] < lengths[:, None]).long()) if masked else None
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grad = torch.randn(q.shape, generator=g).bfloat16()
        bf = [t.bfloat16() for t in (q, k, v)]
        ours = None
        for kernel, fn in KERNELS.items():
            seconds = time_kernel(fn, *bf, mask, grad, args.repeats)
            ours = ours or seconds
            with torch.no_grad():
                err = (fn(*bf, mask).float() - reference).abs().max().item()
            print(f"| {name} | {kernel} | {seconds * 1e3:.2f} | {seconds / ours:.2f}x | {err:.3f} |")


if __name__ == "__main__":
    main()
