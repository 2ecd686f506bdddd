"""Peak resident memory of vltrain's trainer against a bare PyTorch loop of the same model and batch.

The bare loop is the floor for a training step: the model, AdamW's two moments, the gradients
and one step's activations, with nothing else (no loader, no metrics, no checkpoints). The
trainer runs ``vltrain train`` on synthetic images of the same size, through its loader, with a
final checkpoint. Each runs in a process of its own; the figure is the process's peak resident
set (getrusage), read after the last step (the trainer's logged ``peak_memory_gb``) and at exit.

    PYTHONPATH=src python benchmarks/trainer_memory.py [--preset clip-vit-b32] [--batch 32] [--size 224]
        [--steps 3] [--precision fp32,bf16] [--checkout DIR]

``--checkout DIR`` runs the trainer of another checkout of vltrain (say an older commit, made
with ``git worktree add``) on the same data, to compare its memory with today's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def bare(preset: str, batch: int, size: int, steps: int, precision: str) -> float:
    """The bare loop, in this process: peak RSS in GiB after ``steps`` steps."""
    from vltrain.model import build_model
    from vltrain.model.config import LossConfig, ModelConfig
    from vltrain.objectives.scoring import Objectives
    from vltrain.compose.task import Score, Task
    from vltrain.images import Images
    from vltrain.types import ModelInputs

    torch.manual_seed(0)
    loss = LossConfig(itc=1.0, itm=0.0)
    model = build_model(ModelConfig(preset=preset, loss=loss), vocab_size=49408, pad_id=0, mask_id=None,
                        image_size=size, max_text_length=32)
    task = Task(model, Objectives(loss, model.spec))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for _ in range(steps):
        inputs = ModelInputs(
            images=Images(torch.randn(batch, 3, size, size)), input_ids=torch.randint(2, 49000, (batch, 32)),
            attention_mask=torch.ones(batch, 32, dtype=torch.long), has_image=torch.ones(batch, dtype=torch.bool),
            has_text=torch.ones(batch, dtype=torch.bool), ids=torch.arange(batch))
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = task(Score(inputs))
        out.loss.backward()
        opt.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def trainer(work: Path, preset: str, batch: int, size: int, steps: int, precision: str,
            checkout: Path = REPO) -> tuple[float, float]:
    """``vltrain train`` of ``checkout`` in a subprocess: (peak RSS after the last step, at exit), GiB."""
    run = work / f"run-{checkout.name}-{precision}"
    (work / "empty.yaml").write_text("{}\n")
    cmd = [sys.executable, "-c", "import resource, sys; from vltrain.cli.main import main; code = main(sys.argv[1:]); "
           "print('exit peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)",
           "train", str(work / "empty.yaml"), f"run.dir={run}", f"data.train={work / 'shapes' / 'train.jsonl'}",
           "data.val=''", f"data.tokenizer={work / 'tok.json'}", f"data.image_size={size}", "data.max_text_length=32",
           "data.num_workers=1", f"data.batch_size={batch}", f"model.preset={preset}", "model.loss.itm=0",
           f"train.max_steps={steps}", f"train.precision={precision}", "train.log_every=1", "train.progress=false",
           "checkpoint.every=0", "checkpoint.save_initial=never"]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    at_exit = int(next(line for line in proc.stdout.splitlines() if line.startswith("exit peak")).split()[-1])
    return rows[-1]["peak_memory_gb"], at_exit / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="clip-vit-b32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--checkout", type=Path, default=REPO, help="the vltrain checkout whose trainer runs")
    ap.add_argument("--bare", default="", help=argparse.SUPPRESS)  # the bare loop's own process
    args = ap.parse_args()
    if args.bare:
        print(bare(args.preset, args.batch, args.size, args.steps, args.bare))
        return
    from vltrain.data.tools.openclip_tokenizer import find_vocab, openclip_tokenizer
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="vltrain-memory-"))
    synthesize(work / "shapes", 4 * args.batch, 0, seed=0, image_size=args.size)
    if find_vocab() is not None:  # the same 49,408-token embedding as the bare loop's
        openclip_tokenizer().save(str(work / "tok.json"))
    else:
        train_tokenizer(source_texts([str(work / "shapes" / "train.jsonl")]), work / "tok.json", vocab_size=512)
    print(f"{args.preset}, batch {args.batch}, {args.size} px, {args.steps} steps, AdamW; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| precision | bare loop | trainer, after the last step | trainer, at exit | trainer / bare |")
    print("|---|---:|---:|---:|---:|")
    for precision in args.precision.split(","):
        floor = float(subprocess.run([sys.executable, __file__, "--preset", args.preset, "--batch", str(args.batch),
                                      "--size", str(args.size), "--steps", str(args.steps), "--bare", precision],
                                     capture_output=True, text=True, check=True).stdout.split()[-1])
        last, at_exit = trainer(work, args.preset, args.batch, args.size, args.steps, precision,
                                args.checkout.resolve())
        print(f"| {precision} | {floor:.2f} GiB | {last:.2f} GiB | {at_exit:.2f} GiB | {at_exit / floor:.2f}x |")


if __name__ == "__main__":
    main()
