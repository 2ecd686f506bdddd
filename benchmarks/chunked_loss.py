"""The captioning loss over a 256k vocabulary, chunked (``model.loss.caption_chunk``) against whole.

For each token count the decoder's states [T, W], the vocabulary map [V, W] (Gemma's 256,000
tokens, SigLIP 2's decoder width 768) and labels are made once; then the loss and its backward run
the two ways, side by side in one process:

- whole: the unchunked caption path, ``F.linear`` to the [T, V] logits and
  ``vltrain.objectives.losses.token_cross_entropy`` (fp32 ``F.cross_entropy``);
- chunked: ``vltrain.objectives.chunked.chunked_cross_entropy`` with ``chunk`` tokens at a time.

Peak: the most bytes of tensors alive at once from the start of the forward to the end of the
backward, the inputs left out and the weight's gradient (V x W fp32, 750 MiB) counted (the
dispatch-level tracker of ``benchmarks/comm_cost.py``: it sees the tensors operators return, not
the scratch a kernel allocates and frees inside itself, such as logsumexp's). Time: forward and
backward, the least of ``--repeats`` rounds in which the two ways take turns, outside the tracker;
the load average before and after says how much other work shared the cores. Every label is real
(no -100): the chunked path's worst case.

    PYTHONPATH=src python benchmarks/chunked_loss.py [--tokens 512 2048] [--chunks 256 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch

from comm_cost import LiveBytes
from vltrain.objectives.chunked import chunked_cross_entropy
from vltrain.objectives.losses import token_cross_entropy

MIB = 2**20


def cpu_name() -> str:
    """lscpu's model name and family, and whether it has AVX-512 BF16 and AMX."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    family = f"family {fields.get('CPU family', '?').strip()}, model {fields.get('Model', '?').strip()}"
    flags = set(fields.get("Flags", "").split())
    has = lambda flag: "yes" if flag in flags else "no"  # noqa: E731
    return f"{name} ({family}); avx512_bf16: {has('avx512_bf16')}, amx_bf16: {has('amx_bf16')}"


def whole(hidden, weight, labels):
    return token_cross_entropy(torch.nn.functional.linear(hidden, weight)[None], labels[None])


def chunked(chunk: int):
    return lambda hidden, weight, labels: chunked_cross_entropy(hidden, weight, None, labels, 0.0, chunk)


def run(loss_fn, hidden, weight, labels) -> torch.Tensor:
    """Forward and backward; the loss (detached)."""
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels).mean()
    loss.backward()
    return loss.detach()


def peak(loss_fn, hidden, weight, labels) -> tuple[float, torch.Tensor]:
    """(peak MiB, loss) of one forward and backward; the inputs' storages are not counted."""
    tracker = LiveBytes()
    tracker.seen.update(t.untyped_storage().data_ptr() for t in (hidden, weight, labels))  # views of them included
    with tracker:
        loss = run(loss_fn, hidden, weight, labels)
    hidden.grad = weight.grad = None
    return tracker.peak / MIB, loss


def seconds(loss_fns: list, hidden, weight, labels, repeats: int) -> list[float]:
    """The least time of each loss's forward and backward over ``repeats`` rounds in which they take
    turns, so that a load from other work that comes and goes weighs on each alike."""
    best = [float("inf")] * len(loss_fns)
    for _ in range(repeats):
        for i, loss_fn in enumerate(loss_fns):
            start = time.perf_counter()
            run(loss_fn, hidden, weight, labels)
            best[i] = min(best[i], time.perf_counter() - start)
    hidden.grad = weight.grad = None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=256_000)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads")
    print(f"vocabulary {args.vocab:,}, width {args.width}, fp32, every label real\n")
    print("| tokens | chunk | peak whole (MiB) | peak chunked (MiB) | chunked / whole | time whole (s) "
          "| time chunked (s) | chunked / whole | loss difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.width, generator=g) * args.width**-0.5).requires_grad_()
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.width, generator=g).requires_grad_()
        labels = torch.randint(0, args.vocab, (tokens,), generator=g)
        chunks = [c for c in args.chunks if c < tokens]
        fns = [whole] + [chunked(c) for c in chunks]
        peaks, losses = zip(*(peak(fn, hidden, weight, labels) for fn in fns))
        times = seconds(fns, hidden, weight, labels, args.repeats)
        for i, chunk in enumerate(chunks, start=1):
            print(f"| {tokens:,} | {chunk:,} | {peaks[0]:,.0f} | {peaks[i]:,.0f} | {peaks[i] / peaks[0]:.2f}x "
                  f"| {times[0]:.2f} | {times[i]:.2f} | {times[i] / times[0]:.2f}x "
                  f"| {abs(losses[i] - losses[0]).item():.1e} |", flush=True)
    print(f"\nload average (1 min) before: {load_before:.1f}, after: {os.getloadavg()[0]:.1f}")

if __name__ == "__main__":
    main()
