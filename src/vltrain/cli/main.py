"""Command-line parsing only: each command calls one function of the package.

Handlers take the parsed arguments and return an exit code. A :class:`UserError` (bad config,
bad data, missing file) is printed as one clear message, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from vltrain.errors import UserError


def _handler(target: str):
    def run(args: argparse.Namespace) -> int:
        module, _, func = target.partition(":")
        return getattr(importlib.import_module(module), func)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vltrain", description="Train vision-language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _model_commands(sub)
    _data_commands(sub.add_parser("data", help="make, check and convert image-text data"))
    _tokenizer_commands(sub.add_parser("tokenizer", help="train or inspect tokenizers"))
    return p


def _model_commands(sub) -> None:
    """train, demo, eval, export, embed."""
    # vltrain train CONFIG [key=value ...]
    t = sub.add_parser("train", help="train a model from a YAML config (torchrun-aware)")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.batch_size=64")
    t.set_defaults(func=_handler("vltrain.train.trainer:train_cli"))

    d = sub.add_parser("demo", help="synthesize shapes, train a tokenizer and a model, evaluate, plot")
    d.add_argument("--dir", default="runs/demo", help="run folder (default runs/demo)")
    d.add_argument("--data", default="data/shapes", help="where the synthetic data goes (default data/shapes)")
    d.add_argument("--num", type=int, default=10000, help="synthetic training rows (default 10000)")
    d.add_argument("--val", type=int, default=1000, help="held-out pairs (default 1000)")
    d.add_argument("overrides", nargs="*", help="dotted overrides of configs/demo.yaml")
    d.set_defaults(func=_handler("vltrain.demo:demo_cli"))

    e = sub.add_parser("eval", help="retrieval and zero-shot metrics of a run's latest checkpoint or an exported model")
    e.add_argument("path", help="a run folder, an exported model folder, a Hugging Face CLIPModel/SiglipModel "
                                "folder or an OpenCLIP checkpoint")
    e.add_argument("--data", default=None, help="val source (default: the run's data.val)")
    e.add_argument("--zeroshot", default=None, metavar="DIR",
                   help="zero-shot classification on a class-per-folder image set (or a manifest with labels)")
    e.add_argument("--templates", default=None, metavar="FILE", help="prompt templates, one per line with {}")
    e.add_argument("--retrieval", default=None, metavar="FILE", help="COCO-style caption JSON (Karpathy split or annotations)")
    e.add_argument("--split", default="test", help="the Karpathy split to evaluate (default test)")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    e.add_argument("overrides", nargs="*", help="dotted overrides")
    e.set_defaults(func=_handler("vltrain.eval.evaluator:eval_cli"))

    x = sub.add_parser("export", help="write model.safetensors, the tokenizer and the config")
    x.add_argument("run_dir")
    x.add_argument("--out", required=True)
    x.add_argument("--format", choices=["native", "hf"], default="native",
                   help="native (vltrain's, the default) or hf (a folder transformers' CLIPModel/SiglipModel loads)")
    x.add_argument("--interpolate", type=float, default=None, metavar="ALPHA",
                   help="WiSE-FT: (1-ALPHA) x the run's initial weights + ALPHA x the trained ones (0..1)")
    x.set_defaults(func=_handler("vltrain.export.native:export_cli"))

    m = sub.add_parser("embed", help="normalized embeddings of images and texts from an exported model")
    m.add_argument("model_dir", help="an exported model folder, a run folder, a Hugging Face CLIPModel/SiglipModel "
                                     "folder or an OpenCLIP checkpoint")
    m.add_argument("--tokenizer", default=None, help="tokenizer.json (an OpenCLIP checkpoint without one beside it)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config value, e.g. model.preset=clip-vit-b16 or model.quick_gelu=true (repeatable)")
    m.add_argument("--images", nargs="*", default=[])
    m.add_argument("--texts", nargs="*", default=[])
    m.add_argument("--out", required=True, help=".npy file (images first, then texts)")
    m.set_defaults(func=_handler("vltrain.export.native:embed_cli"))


def _data_commands(data: argparse.ArgumentParser) -> None:
    """vltrain data synth | validate | index | stats | shard | audit."""
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")

    s = dsub.add_parser("synth", help="write the synthetic 'shapes' dataset (images + JSONL manifests)")
    s.add_argument("--out", default=None, help="where the image-text pairs go")
    s.add_argument("--classify", default=None, metavar="OUT",
                   help="also (or only) write a class-per-folder set: one shape per image, class = shape kind")
    s.add_argument("--per-class", type=int, default=50, help="images per class of --classify (default 50)")
    s.add_argument("--num", type=int, default=10000, help="training rows")
    s.add_argument("--val", type=int, default=1000, help="validation rows (image-text pairs)")
    s.add_argument("--text-only-fraction", type=float, default=0.0, help="training rows without an image")
    s.add_argument("--image-only-fraction", type=float, default=0.0, help="training rows without a caption")
    s.add_argument("--image-size", type=int, default=48)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--workers", type=int, default=0, help="processes (0: all cores)")
    s.set_defaults(func=_handler("vltrain.data.tools.synth:synth_cli"))

    v = dsub.add_parser("validate", help="check every row; exit 0 clean, 1 problems found, 2 usage error")
    v.add_argument("sources", nargs="+", help="manifests (.jsonl/.csv/.tsv) or shard patterns")
    v.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    v.add_argument("--max-problems", type=int, default=20, help="problems to print (default 20)")
    v.add_argument("--workers", type=int, default=1, help="processes decoding images (default 1)")
    v.set_defaults(func=_handler("vltrain.data.tools.validate:validate_cli"))

    ix = dsub.add_parser("index", help="build the sample index of sources (else built on first use)")
    ix.add_argument("sources", nargs="+", help="manifests (.jsonl/.csv/.tsv) or shard patterns")
    ix.add_argument("--tokenizer", default=None, help="tokenizer.json whose token counts the index stores")
    ix.add_argument("--max-text-length", type=int, default=None, help="token cap (default 77, or the config's)")
    ix.add_argument("--config", default=None, help="take the tokenizer, text length and cache folder from a config")
    ix.add_argument("--cache-dir", default=None, help="where indexes of read-only data go")
    ix.add_argument("--workers", type=int, default=0, help="processes (0: all cores)")
    ix.set_defaults(func=_handler("vltrain.data.index.open:index_cli"))

    st = dsub.add_parser("stats", help="counts by modality, caption token lengths, image sizes")
    st.add_argument("sources", nargs="+")
    st.add_argument("--tokenizer", default=None, help="count caption lengths in its tokens (default: words)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--max-images", type=int, default=2000, help="images to measure (a sample, default 2000)")
    st.set_defaults(func=_handler("vltrain.data.tools.validate:stats_cli"))

    sh = dsub.add_parser("shard", help="write img2dataset-style tar shards from a manifest")
    sh.add_argument("manifest")
    sh.add_argument("--out", required=True)
    sh.add_argument("--shard-size", type=int, default=1000)
    sh.set_defaults(func=_handler("vltrain.data.sources.shards:shard_cli"))

    a = dsub.add_parser("audit", help="check a run's consumed-id records: no duplicates, nothing lost")
    a.add_argument("run_dir")
    a.set_defaults(func=_handler("vltrain.data.loading.audit:audit_cli"))


def _tokenizer_commands(tok: argparse.ArgumentParser) -> None:
    """vltrain tokenizer train."""
    tsub = tok.add_subparsers(dest="tokenizer_command", required=True, metavar="TOKENIZER_COMMAND")
    tt = tsub.add_parser("train", help="train a BPE or WordPiece tokenizer on a manifest's texts")
    tt.add_argument("sources", nargs="+")
    tt.add_argument("--out", required=True, help="tokenizer.json to write")
    tt.add_argument("--vocab-size", type=int, default=4096)
    tt.add_argument("--kind", choices=["bpe", "wordpiece"], default="bpe")
    tt.set_defaults(func=_handler("vltrain.data.tokenizers:train_tokenizer_cli"))


def _setup_logging() -> None:
    """vltrain's own log lines (epoch remainders, skipped rows) on stderr; INFO on rank 0 only."""
    logger = logging.getLogger("vltrain")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(logging.Formatter("vltrain: %(message)s" if rank == "0" else f"vltrain[rank {rank}]: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == "0" else logging.WARNING)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging()
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0" or getattr(e, "label", "error") == "error":
            print(f"vltrain: {getattr(e, 'label', 'error')}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("vltrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
