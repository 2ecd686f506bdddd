"""``vltrain train | demo | eval | export | embed | caption``: their arguments and handlers.

Each handler imports what it runs when it runs, so ``vltrain --help`` and the data commands do not
pay for importing the trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from vltrain.errors import DataError, UsageError


MODEL_HELP = ("a run folder, a checkpoint, an exported model folder, or an imported model (a Hugging Face "
              "CLIP, SigLIP, SigLIP 2 or BLIP folder, an OpenCLIP checkpoint, or either by its Hub name, "
              "hf-hub:ORG/NAME[@REVISION])")
"""What ``MODEL`` may be in every command that opens a model (eval, export, embed, caption)."""


def _add_model(parser, also: str = "") -> None:
    """The one positional argument of the commands that open a model: ``MODEL``, named alike in each."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP + also)


def _add_overrides(parser, help_text: str = "dotted overrides, e.g. train.lr=3e-4 data.batch_size=64") -> None:
    """Every command that reads a config takes overrides the same two ways: ``key=value`` after its
    positional arguments, or ``--set key=value`` anywhere (repeatable)."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=help_text)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set_overrides",
                        help="the same, as an option (repeatable), e.g. --set model.preset=clip-vit-b16")


def overrides_of(args: argparse.Namespace) -> list[str]:
    return list(args.overrides or []) + list(args.set_overrides or [])


def _add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="retrieval and zero-shot metrics of a run's latest checkpoint or any model")
    _add_model(e)
    e.add_argument("--data", default=None, help="val source (default: the run's data.val)")
    e.add_argument("--zeroshot", default=None, metavar="DIR",
                   help="zero-shot classification on a class-per-folder image set (or a manifest with labels)")
    e.add_argument("--templates", default=None, metavar="FILE", help="prompt templates, one per line with {}")
    e.add_argument("--retrieval", default=None, metavar="FILE", help="COCO-style caption JSON (Karpathy split or annotations)")
    e.add_argument("--captions", default=None, metavar="FILE",
                   help="COCO-style caption JSON: caption its images (a model with a decoder), BLEU-4 and CIDEr-D")
    e.add_argument("--referring", default=None, metavar="FILE",
                   help='JSON lines {"image", "text", "box": [x0, y0, x1, y1]} (pixels): a LocCa model\'s '
                        "referring-expression Acc@0.5 and mean IoU")
    e.add_argument("--dense", default=None, metavar="FILE",
                   help='JSON lines {"image", "mask"} (class-index PNGs): a linear probe on the frozen patch '
                        "tokens, trained on the first half, mean IoU on the rest")
    e.add_argument("--split", default="test", help="the Karpathy split to evaluate (default test)")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    e.add_argument("--ema", action="store_true", help="a run's EMA weights (train.ema) instead of its trained ones")
    _add_overrides(e)
    e.set_defaults(func=evaluate)


def add_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a model from a YAML config (torchrun-aware)")
    t.add_argument("config", help="YAML config file")
    _add_overrides(t)
    t.set_defaults(func=train)

    d = sub.add_parser("demo", help="synthesize shapes, train a tokenizer and a model, evaluate, plot")
    d.add_argument("--dir", default="runs/demo", help="run folder (default runs/demo)")
    d.add_argument("--data", default="data/shapes", help="where the synthetic data goes (default data/shapes)")
    d.add_argument("--num", type=int, default=20000, help="synthetic training rows (default 20000)")
    d.add_argument("--val", type=int, default=1000, help="held-out pairs (default 1000)")
    _add_overrides(d, "dotted overrides of configs/demo.yaml")
    d.set_defaults(func=demo)

    _add_eval_parser(sub)

    x = sub.add_parser("export", help="write model.safetensors, the tokenizer and the config")
    _add_model(x)
    x.add_argument("--out", required=True)
    x.add_argument("--format", choices=["native", "hf", "openclip"], default="native",
                   help="native (vltrain's, the default), hf (a folder transformers' CLIPModel/SiglipModel/"
                        "BlipForConditionalGeneration loads) or openclip (a CoCa folder open_clip opens as "
                        "local-dir:FOLDER)")
    x.add_argument("--interpolate", type=float, default=None, metavar="ALPHA",
                   help="WiSE-FT: (1-ALPHA) x the run's initial weights + ALPHA x the trained ones (0..1)")
    x.add_argument("--ema", action="store_true",
                   help="the run's EMA weights (train.ema) instead of its trained ones (with --interpolate: blended)")
    x.add_argument("--adapters", action="store_true",
                   help="a LoRA run's adapters alone (train.lora), as peft's folder (adapter_config.json, "
                        "adapter_model.safetensors) for the transformers model of model.init; without it a LoRA "
                        "run is exported with its adapters merged")
    x.set_defaults(func=export)

    _add_caption_parser(sub)

    m = sub.add_parser("embed", help="normalized embeddings of images and texts from any model vltrain opens")
    _add_model(m)
    m.add_argument("--tokenizer", default=None, help="tokenizer.json (an OpenCLIP checkpoint without one beside it)")
    _add_overrides(m, "config values, e.g. model.preset=clip-vit-b16 or model.quick_gelu=true")
    m.add_argument("--images", nargs="*", default=[])
    m.add_argument("--texts", nargs="*", default=[])
    m.add_argument("--out", required=True, help=".npy file (images first, then texts), or .npz (arrays images, texts)")
    m.set_defaults(func=embed)


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a usage error otherwise, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _probability(text: str) -> float:
    """An argparse type: a probability in (0, 1] (0 would keep no token)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def _add_caption_parser(sub) -> None:
    c = sub.add_parser("caption", help="captions of images from a model with a captioning decoder (torchrun-aware)")
    _add_model(c, ", with a captioning decoder")
    c.add_argument("--images", nargs="+", required=True)
    search = c.add_mutually_exclusive_group()
    search.add_argument("--beam", type=int, default=1, help="beams of the search (default 1: greedy)")
    search.add_argument("--top-p", type=_probability, default=None, dest="top_p",
                        help="nucleus sampling: draw from the most likely tokens holding this probability, in (0, 1]")
    c.add_argument("--seed", type=int, default=0, help="--top-p's seed (each image's draws: this and its place)")
    c.add_argument("--max-length", type=_at_least_one, default=None, dest="max_length",
                   help="tokens a caption may take, the start token included (default: the model's text length)")
    c.add_argument("--prompt", default="", help='text every caption starts with, e.g. "a photo of"')
    c.add_argument("--batch-size", type=_at_least_one, default=32, dest="batch_size", help="images per batch per rank")
    c.add_argument("--no-cache", action="store_false", dest="cache",
                   help="recompute every position at each token instead of caching keys and values")
    c.add_argument("--boxes", nargs="+", default=None, metavar="X0,Y0,X1,Y1",
                   help="a LocCa model (tiny-siglip2): the phrase of a box of each image (pixels of the image as "
                        "shown), one box per image or one for all: a grounded caption")
    c.add_argument("--out", default=None, help="write JSON lines {image, caption} here instead of printing")
    _add_overrides(c)
    c.set_defaults(func=caption)

    g = sub.add_parser("ground", help="the box a phrase names in an image, from a model with a LocCa decoder "
                                      "(torchrun-aware)")
    _add_model(g, ", with a LocCa decoder (tiny-siglip2, siglip2-vit-b16)")
    g.add_argument("--images", nargs="+", required=True)
    g.add_argument("--texts", nargs="+", required=True,
                   help="one phrase per image, or several for one image, or one for every image")
    g.add_argument("--batch-size", type=_at_least_one, default=32, dest="batch_size", help="pairs per batch per rank")
    g.add_argument("--out", default=None, help="write JSON lines {image, text, box} here instead of printing")
    _add_overrides(g)
    g.set_defaults(func=ground)


def say(line: str, stream=None) -> None:
    """``line`` and its line break in one write. Under torchrun the ranks share the launcher's
    streams unbuffered (``python -u``), and ``print`` writes the text and its line break apart, so
    another rank's output could land between them."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


def train(args: argparse.Namespace) -> int:
    """``vltrain train CONFIG [key=value ...]`` (under torchrun or in one process)."""
    from vltrain.config.job import load_config
    from vltrain.errors import UserError
    from vltrain.eval.evaluator import format_metrics
    from vltrain.runtime.preemption import Preempted
    from vltrain.train.trainer import Trainer

    cfg = load_config(args.config, overrides_of(args))
    trainer = Trainer(cfg)
    clean = False
    try:
        metrics = trainer.train()
        clean = True
    except Preempted:
        clean = True
        raise
    except (UserError, KeyboardInterrupt):
        raise  # said once, by vltrain.cli.main
    except BaseException as e:
        lost = _peer_lost(e) if trainer.world.world_size > 1 else ""
        if lost:
            # another rank stopped, or stopped answering: this one only names itself, so that the
            # cause (that rank's own message, if it could say one) is not buried under tracebacks
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            print(f"vltrain: rank {trainer.world.rank} stopped at step {trainer.step}: {lost}: {type(e).__name__}: "
                  f"{first}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        # a fault of vltrain's own: the line naming the failed rank, then its traceback; the other
        # ranks then fail on the broken group (or are stopped by torchrun), within train.timeout_s
        say(f"vltrain: rank {trainer.world.rank} failed at step {trainer.step}: {type(e).__name__}: {e}", sys.stderr)
        raise
    finally:
        trainer.close(clean)
    if trainer.world.is_main:
        bad, log = trainer.bad_samples, trainer.loader.bad_log
        lost = log.lost if log is not None else 0
        counts = ", ".join([f"{bad} replaced"] * bool(bad) + [f"{lost} lost in damaged files"] * bool(lost))
        replaced = f"  bad samples: {counts} ({trainer.run_dir / 'bad_samples.jsonl'})" if counts else ""
        say(f"run: {trainer.run_dir}  steps: {trainer.step}  skipped: {trainer.guard.total}{replaced}")
        if metrics:
            say(f"eval: {format_metrics(metrics)}")
    return 0


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
"""What gloo says when a collective's peer process has gone."""
PEER_SILENT = ("Timed out waiting", "timed out after", "Socket Timeout")
"""What gloo and the store say when a peer did not answer within the group's timeout."""


def _peer_lost(e: BaseException) -> str:
    """Why a collective failed if another rank's process exited or stopped answering, in words;
    "" for any other error."""
    import torch.distributed as dist

    text = str(e)
    if isinstance(e, RuntimeError) and any(p in text for p in PEER_SILENT):
        return ("a peer did not answer within train.timeout_s (a rank or node that hangs, or that the network "
                "cannot reach)")
    if isinstance(e, dist.DistNetworkError) or (isinstance(e, RuntimeError) and any(p in text for p in PEER_LOST)):
        return "lost its peers (another rank or node stopped; its own message, if it could write one, says why)"
    return ""


def demo(args: argparse.Namespace) -> int:
    """``vltrain demo``: the shapes data, a tokenizer, a model trained for about 3 minutes, its figures."""
    import time

    from vltrain.data.tools.synth import KINDS
    from vltrain.demo import run_demo
    from vltrain.eval.evaluator import format_metrics

    start = time.perf_counter()
    run_dir = Path(args.dir)
    trainer, metrics = run_demo(run_dir, Path(args.data), overrides_of(args), args.num, args.val)
    if trainer.world.is_main:
        minutes = (time.perf_counter() - start) / 60
        print(f"\ndone in {minutes:.1f} min, {trainer.step} steps, {trainer.samples_seen:,} samples")
        if metrics:
            pairs = {k: v for k, v in metrics.items() if "/" not in k and k != "num_pairs"}
            print(f"held-out retrieval ({metrics['num_pairs']} pairs): {format_metrics(pairs)}")
            print(f"text->image R@1 = {metrics['t2i_r1']:.3f} (chance: {1 / max(metrics['num_pairs'], 1):.3f})")
        if "zeroshot/shapes/top1" in metrics:
            print(f"zero-shot shape kind ({metrics['zeroshot/shapes/num_images']} images, {len(KINDS)} classes): "
                  f"top-1 = {metrics['zeroshot/shapes/top1']:.3f} (chance: {1 / len(KINDS):.3f})")
        if "captions/shapes/cider" in metrics:
            _print_captions(trainer, Path(args.data), metrics)
        if "referring/shapes/acc50" in metrics:
            from vltrain.demo import draw_grounding

            print(f"referring expressions ({metrics['referring/shapes/num_pairs']} held-out phrases): Acc@0.5 = "
                  f"{metrics['referring/shapes/acc50']:.3f}, mean IoU = {metrics['referring/shapes/miou']:.3f}")
            print(f"grounding: {draw_grounding(trainer, Path(args.data), run_dir / 'grounding.png')}")
        print(f"run:     {run_dir}  (metrics.jsonl, eval.json, tb/ for TensorBoard)")
        print(f"curves:  {run_dir / 'curves.png'}")
    return 0


def _print_captions(trainer, data: Path, metrics: dict) -> None:
    """The demo's captioning: a few held-out images' captions beside the truth, and the metrics."""
    from vltrain.demo import show_captions

    print(f"captions of {metrics['captions/shapes/num_images']} held-out images (greedy): "
          f"BLEU-4 = {metrics['captions/shapes/bleu4']:.3f}, CIDEr-D = {metrics['captions/shapes/cider']:.3f}")
    for truth, made in show_captions(trainer, data):
        print(f"  truth:     {truth}\n  generated: {made}")


def evaluate(args: argparse.Namespace) -> int:
    """``vltrain eval MODEL``: metrics of the model's weights on its val set and evaluation sets, or on
    the sets the command line names."""
    from vltrain.eval.evaluator import evaluate_run, format_table, rounded

    overrides = overrides_of(args)
    if args.zeroshot:
        name = Path(args.zeroshot).stem or "zeroshot"
        overrides.append(f"eval.zeroshot=[{{name: {json.dumps(name)}, path: {json.dumps(str(args.zeroshot))}, "
                         f"templates: {json.dumps(args.templates or '')}}}]")
    if args.retrieval:
        name = Path(args.retrieval).stem or "retrieval"
        overrides.append(f"eval.retrieval=[{{name: {json.dumps(name)}, path: {json.dumps(str(args.retrieval))}, "
                         f"split: {json.dumps(args.split)}}}]")
    if args.captions:
        name = Path(args.captions).stem or "captions"
        overrides.append(f"eval.captions=[{{name: {json.dumps(name)}, path: {json.dumps(str(args.captions))}, "
                         f"split: {json.dumps(args.split)}}}]")
    if args.referring:
        name = Path(args.referring).stem or "referring"
        overrides.append(f"eval.referring=[{{name: {json.dumps(name)}, path: {json.dumps(str(args.referring))}}}]")
    if args.dense:
        name = Path(args.dense).stem or "dense"
        overrides.append(f"eval.dense=[{{name: {json.dumps(name)}, path: {json.dumps(str(args.dense))}}}]")
    only_sets = bool(args.zeroshot or args.retrieval or args.captions or args.referring or args.dense)
    if only_sets:
        for key in ("zeroshot", "retrieval", "captions", "referring", "dense"):
            overrides += [] if getattr(args, key) else [f"eval.{key}=[]"]
    metrics = evaluate_run(Path(args.model), data=args.data, overrides=overrides,
                           val=args.data is not None or not only_sets, ema=args.ema)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(rounded(metrics), indent=1) if args.json else format_table(metrics))
    return 0


def export(args: argparse.Namespace) -> int:
    """``vltrain export MODEL --out DIR [--interpolate ALPHA] [--ema] [--adapters]``."""
    from vltrain.export.native import export_model

    alpha = args.interpolate
    if args.adapters:
        return _export_adapters(args)
    out = export_model(args.model, args.out, interpolate=alpha, fmt=args.format, ema=args.ema)
    trained = "EMA" if args.ema else "fine-tuned"
    blend = f" (weights: {1 - alpha:g} x initial + {alpha:g} x {trained})" if alpha is not None else (
        " (the EMA weights)" if args.ema else "")
    files = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
    print(f"exported to {out} ({args.format}): {files}{blend}")
    return 0


def _export_adapters(args: argparse.Namespace) -> int:
    """``vltrain export RUN --adapters --out DIR [--ema]``: peft's folder, whatever the format."""
    from vltrain.export.adapters import export_adapters

    if args.interpolate is not None or args.format != "native":
        given = "--interpolate" if args.interpolate is not None else f"--format {args.format}"
        raise UsageError(f"export --adapters writes peft's adapter folder, which has no {given}: give one or the "
                         "other")
    out = export_adapters(args.model, args.out, ema=args.ema)
    files = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
    print(f"exported the adapters to {out} (peft){' (their EMA)' if args.ema else ''}: {files}")
    return 0


def embed(args: argparse.Namespace) -> int:
    """``vltrain embed MODEL --images a.jpg b.png --texts "..." --out emb.npy``."""
    import numpy as np
    import torch

    from vltrain.compose.opening import open_model
    from vltrain.export.native import embed as embed_inputs

    if not args.images and not args.texts:
        raise UsageError("nothing to embed: give --images and/or --texts")
    torch.set_grad_enabled(False)
    overrides = overrides_of(args) + ([f"data.tokenizer={args.tokenizer}"] if args.tokenizer else [])
    opened = open_model(args.model, overrides, purpose="embed")
    emb = embed_inputs(opened.model, opened.tokenizer, opened.cfg, args.images, args.texts)
    out = Path(args.out)
    if out.suffix == ".npz":  # two named arrays
        np.savez(out, images=emb[:len(args.images)], texts=emb[len(args.images):])
        what = "arrays images and texts"
    else:  # one array, images first; numpy names the file .npy
        out = out if out.suffix == ".npy" else out.with_name(out.name + ".npy")
        np.save(out, emb)
        what = "images first"
    print(f"wrote {out}: {len(args.images)} image and {len(args.texts)} text embeddings of size "
          f"{emb.shape[1]} ({what})")
    return 0


def caption(args: argparse.Namespace) -> int:
    """``vltrain caption MODEL --images a.jpg b.jpg [--beam N | --top-p P]``: one line per image
    (``path<TAB>caption``), or JSON lines in ``--out``; on several ranks the images are split and
    rank 0 writes."""
    from vltrain.eval.captioning import caption_images

    if args.boxes is not None:
        return _caption_boxes(args)
    rows = caption_images(Path(args.model), args.images, overrides_of(args), beam=args.beam,
                          top_p=args.top_p or 0.0, seed=args.seed, max_length=args.max_length or 0, prompt=args.prompt,
                          batch_size=args.batch_size, cache=args.cache)
    if all(text is None for _, text in rows):
        raise DataError(f"none of the {len(rows)} images could be read (vltrain data validate names why)")
    if os.environ.get("RANK", "0") != "0":
        return 0
    if args.out:
        with open(args.out, "w") as f:
            for path, text in rows:
                f.write(json.dumps({"image": path, "caption": text}) + "\n")
        print(f"wrote {len(rows)} captions to {args.out}")
    else:
        for path, text in rows:
            print(f"{path}\t{text if text is not None else '(unreadable)'}")
    return 0


def _pairs(images: list[str], texts: list[str]) -> tuple[list[str], list[str]]:
    """``vltrain ground``'s (image, text) pairs: one each, one image for every text, or one text for every image."""
    if len(images) == len(texts):
        return images, texts
    if len(images) == 1:
        return images * len(texts), texts
    if len(texts) == 1:
        return images, texts * len(images)
    raise UsageError(f"--images gives {len(images)} and --texts {len(texts)}: give one text per image, several "
                     "texts for one image, or one text for every image")


def _boxes(values: list[str], n: int) -> list[list[float]]:
    """``--boxes``: one ``x0,y0,x1,y1`` per image, or one for all of them."""
    boxes = []
    for v in values:
        try:
            box = [float(x) for x in v.split(",")]
        except ValueError:
            box = []
        if len(box) != 4 or not (box[0] < box[2] and box[1] < box[3]):
            raise UsageError(f"--boxes {v!r}: a box is x0,y0,x1,y1 in pixels with x0 < x1 and y0 < y1")
        boxes.append(box)
    if len(boxes) not in (1, n):
        raise UsageError(f"--boxes gives {len(boxes)} boxes for {n} images: give one per image, or one for all")
    return boxes * n if len(boxes) == 1 else boxes


def ground(args: argparse.Namespace) -> int:
    """``vltrain ground MODEL --images a.jpg --texts "the red circle"``: one line per pair
    (``path<TAB>text<TAB>x0,y0,x1,y1`` in pixels of the image as shown), or JSON lines in ``--out``."""
    from vltrain.eval.grounding import ground_images

    images, texts = _pairs(args.images, args.texts)
    rows = ground_images(Path(args.model), images, texts, overrides_of(args), batch_size=args.batch_size)
    if all(box is None for *_, box in rows):
        raise DataError(f"none of the {len(rows)} images could be read (vltrain data validate names why)")
    if os.environ.get("RANK", "0") != "0":
        return 0
    if args.out:
        with open(args.out, "w") as f:
            for image, text, box in rows:
                f.write(json.dumps({"image": image, "text": text, "box": box}) + "\n")
        print(f"wrote {len(rows)} boxes to {args.out}")
    else:
        for image, text, box in rows:
            shown = ",".join(f"{v:g}" for v in box) if box is not None else "(unreadable)"
            print(f"{image}\t{text}\t{shown}")
    return 0


def _caption_boxes(args: argparse.Namespace) -> int:
    """``vltrain caption MODEL --images a.jpg --boxes x0,y0,x1,y1``: grounded captions."""
    from vltrain.eval.grounding import caption_boxes

    if args.beam != 1 or args.top_p or args.prompt:
        raise UsageError("--boxes captions greedily, without a prompt: leave out --beam, --top-p and --prompt")
    boxes = _boxes(args.boxes, len(args.images))
    rows = caption_boxes(Path(args.model), args.images, boxes, overrides_of(args), max_length=args.max_length or 0,
                         batch_size=args.batch_size)
    if all(text is None for _, text in rows):
        raise DataError(f"none of the {len(rows)} images could be read (vltrain data validate names why)")
    if os.environ.get("RANK", "0") != "0":
        return 0
    with open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout) as f:
        for (path, text), box in zip(rows, boxes):
            if args.out:
                f.write(json.dumps({"image": path, "box": box, "caption": text}) + "\n")
            else:
                say(f"{path}\t{','.join(f'{v:g}' for v in box)}\t{text if text is not None else '(unreadable)'}")
    if args.out:
        print(f"wrote {len(rows)} grounded captions to {args.out}")
    return 0
