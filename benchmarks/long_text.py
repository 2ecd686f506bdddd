"""Long captions on a CLIP whose context is 77 tokens: truncated, or read through its stretched
position table (Long-CLIP, ``data.max_text_length`` above the checkpoint's context).

The CLIP is a small one made by transformers' own class (``CLIPModel``: 48-pixel images in 16-pixel
patches, ``--width``-wide towers of ``--depth`` layers, OpenCLIP's BPE of 49,408 tokens, 77 text
positions), trained first for ``--pretrain-steps`` on the ordinary shapes data (short captions) and
exported with ``vltrain export --format hf``: a checkpoint that has only ever read short text, as
OpenAI's CLIP had. It is then fine-tuned for ``--steps`` on the long-caption shapes
(``vltrain data synth --long-captions``: 6 to 9 shapes named in reading order) two ways, at equal
steps, batch, learning rate and seed:

- truncated: ``data.max_text_length=77``, every caption cut at 77 tokens (the bottom row lost);
- stretched: ``data.max_text_length=248`` with ``model.text.stretch_keep=20`` (Long-CLIP's sizes).

Printed: the long held-out captions' token lengths, then for the starting checkpoint (read both
ways) and each fine-tune, t2i and i2t R@1 on the long held-out pairs and on the ordinary (short)
held-out pairs, and the fine-tune's wall time.

    PYTHONPATH=src python benchmarks/long_text.py [--steps 250] [--pretrain-steps 250] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ema_demo import cpu_name  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
SHORT, LONG, KEEP = 77, 248, 20


def vltrain(*args) -> tuple[str, float]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vltrain", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"vltrain {' '.join(map(str, args[:3]))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout, time.perf_counter() - start


def make_clip(folder: Path, width: int, depth: int) -> None:
    """A random CLIPModel with OpenCLIP's tokenizer, saved as a user would have it."""
    import torch
    import transformers

    from vltrain.data.tools.openclip_tokenizer import openclip_tokenizer

    folder.mkdir(parents=True)
    tok = openclip_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = tok.token_to_id("<start_of_text>"), tok.token_to_id("<end_of_text>")
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
                 num_attention_heads=max(1, width // 64))
    config = transformers.CLIPConfig(
        text_config={**tower, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": SHORT,
                     "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos},
        vision_config={**tower, "image_size": 48, "patch_size": 16}, projection_dim=width)
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 48}, crop_size={"height": 48, "width": 48}
                                    ).save_pretrained(folder)


def train(base: Path, init: Path, data: Path, run_dir: Path, steps: int, args, *overrides: str) -> float:
    _, took = vltrain("train", base, f"model.init={init}", f"data.train={data / 'train.jsonl'}",
                      f"data.val={data / 'val.jsonl'}", f"run.dir={run_dir}", f"train.max_steps={steps}",
                      f"data.batch_size={args.batch}", f"train.lr={args.lr}", f"train.warmup_steps={steps // 10}",
                      f"train.seed={args.seed}", "train.precision=fp32", "data.text_clean=clip",
                      "data.num_workers=1", "checkpoint.every=0", "metrics.curves=false", "train.progress=false",
                      f"eval.every={steps}",
                      *overrides)
    return took


def recall(model: Path, data: Path, *overrides: str) -> tuple[float, float]:
    out, _ = vltrain("eval", model, "--data", data / "val.jsonl", "--json", "data.text_clean=clip",
                     "train.precision=fp32", *overrides)
    metrics = json.loads(out)
    return metrics["t2i_r1"], metrics["i2t_r1"]


def lengths(data: Path, tokenizer: Path) -> np.ndarray:
    from vltrain.data.tokenizers import load_tokenizer

    tok = load_tokenizer(str(tokenizer), "clip")
    rows = [json.loads(line) for line in open(data / "val.jsonl")]
    return np.array([len(tok.encode(r["text"], 1000)[0]) for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=250, help="fine-tuning steps on the long captions, each arm")
    p.add_argument("--pretrain-steps", type=int, default=250, help="steps on the ordinary shapes first")
    p.add_argument("--num", type=int, default=3000, help="training rows of each data set")
    p.add_argument("--val", type=int, default=500, help="held-out pairs of each data set")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the data and runs here (default: a temporary folder)")
    args = p.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from vltrain.data.tools.synth import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = work / "base.yaml"
        base.write_text("# everything is given on the command line\n{}\n")
        short, long = work / "shapes", work / "shapes-long"
        synthesize(short, args.num, args.val, seed=args.seed)
        synthesize(long, args.num, args.val, seed=args.seed, long_captions=True)
        make_clip(work / "random", args.width, args.depth)
        took = train(base, work / "random", short, work / "pretrain", args.pretrain_steps, args)
        vltrain("export", work / "pretrain", "--out", work / "clip", "--format", "hf")
        print(f"pretrained {args.pretrain_steps} steps on short captions in {took:.0f} s", flush=True)

        stretched = [f"data.max_text_length={LONG}", f"model.text.stretch_keep={KEEP}"]
        rows = [("start, truncated", recall(work / "clip", long), recall(work / "clip", short), None),
                ("start, stretched", recall(work / "clip", long, *stretched),
                 recall(work / "clip", short, *stretched), None)]
        for name, extra in (("truncated", [f"data.max_text_length={SHORT}"]), ("stretched", stretched)):
            took = train(base, work / "clip", long, work / name, args.steps, args, *extra)
            rows.append((f"fine-tuned, {name}", recall(work / name, long), recall(work / name, short), took))
            print(f"fine-tuned {name} in {took:.0f} s", flush=True)
        n = lengths(long, work / "clip" / "tokenizer.json")

    print(f"\nlong captions (CLIP BPE tokens, {len(n)} held-out): min {n.min()}, median {int(np.median(n))}, "
          f"max {n.max()}, {100 * (n > SHORT).mean():.0f}% past {SHORT}")
    print(f"CLIPModel width {args.width}, depth {args.depth}; {args.pretrain_steps} steps on short captions, then "
          f"{args.steps} on long ones; batch {args.batch}, lr {args.lr}, seed {args.seed}; {cpu_name()} "
          f"({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}")
    print("| model | long t2i R@1 | long i2t R@1 | short t2i R@1 | short i2t R@1 | fine-tune time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (lt, li), (st, si), took in rows:
        print(f"| {name} | {lt:.3f} | {li:.3f} | {st:.3f} | {si:.3f} | {'' if took is None else f'{took:.0f} s'} |")


if __name__ == "__main__":
    main()
