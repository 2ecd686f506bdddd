"""``vltrain data synth | validate | index | stats | shard | from-coco | audit`` and ``vltrain tokenizer train``:
their arguments, handlers and printed reports."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def add_parsers(data: argparse.ArgumentParser, tokenizer: argparse.ArgumentParser) -> None:
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    _add_synth_parser(dsub)

    v = dsub.add_parser("validate", help="check every row; exit 0 clean, 1 problems found, 2 usage error")
    v.add_argument("sources", nargs="+", help="manifests (.jsonl/.csv/.tsv), shard patterns or .parquet files")
    v.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    v.add_argument("--max-problems", type=int, default=20, help="problems to print (default 20)")
    v.add_argument("--workers", type=int, default=0, help="processes decoding images (default 0: one per core)")
    v.set_defaults(func=validate)

    ix = dsub.add_parser("index", help="build the sample index of sources (else built on first use)")
    ix.add_argument("sources", nargs="+", help="manifests (.jsonl/.csv/.tsv), shard patterns or .parquet files")
    ix.add_argument("--tokenizer", default=None, help="tokenizer.json whose token counts the index stores")
    ix.add_argument("--max-text-length", type=int, default=None, help="token cap (default 77, or the config's)")
    ix.add_argument("--config", default=None, help="take the tokenizer, text length and cache folder from a config")
    ix.add_argument("--cache-dir", default=None, help="where indexes of read-only data go")
    ix.add_argument("--image-sizes", action="store_true",
                    help="also read every image's size from its header (what data.patch_budget plans with)")
    ix.add_argument("--workers", type=int, default=0, help="processes (0: all cores)")
    ix.set_defaults(func=index)

    st = dsub.add_parser("stats", help="counts by modality, caption token lengths, image sizes")
    st.add_argument("sources", nargs="+")
    st.add_argument("--tokenizer", default=None, help="count caption lengths in its tokens (default: words)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--max-images", type=int, default=2000, help="images to measure (a sample, default 2000)")
    st.set_defaults(func=stats)

    _add_shard_parser(dsub)
    _add_coco_parser(dsub)

    _add_teacher_embed_parser(dsub)

    a = dsub.add_parser("audit", help="check a run's consumed-id records: no duplicates, nothing lost")
    a.add_argument("run_dir")
    a.set_defaults(func=audit)

    tsub = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="TOKENIZER_COMMAND")
    tt = tsub.add_parser("train", help="train a BPE or WordPiece tokenizer on a manifest's texts")
    tt.add_argument("sources", nargs="+")
    tt.add_argument("--out", required=True, help="tokenizer.json to write")
    tt.add_argument("--vocab-size", type=int, default=4096)
    tt.add_argument("--kind", choices=["bpe", "wordpiece"], default="bpe")
    tt.set_defaults(func=train_tokenizer)
    to = tsub.add_parser("from-openclip", help="OpenCLIP's (and OpenAI CLIP's) tokenizer as a tokenizer.json")
    to.add_argument("vocab", nargs="?", default=None,
                    help="its bpe_simple_vocab_16e6.txt.gz (default: the one of an installed open_clip)")
    to.add_argument("--out", required=True, help="tokenizer.json to write")
    to.set_defaults(func=openclip_tokenizer)


def _add_synth_parser(dsub) -> None:
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
    s.add_argument("--regions", action="store_true",
                   help="each row with an image lists its shapes' boxes and phrases (\"regions\")")
    s.add_argument("--long-captions", action="store_true",
                   help="6 to 9 shapes per image, each named in a long caption (most past CLIP's 77 tokens)")
    s.add_argument("--masks", action="store_true",
                   help="also each val image's segmentation mask, listed in OUT/dense.jsonl (vltrain eval --dense)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--workers", type=int, default=0, help="processes (0: all cores)")
    s.set_defaults(func=synth)


def _add_teacher_embed_parser(dsub) -> None:
    te = dsub.add_parser("teacher-embed", help="store a distillation teacher's embeddings of every row beside "
                         "each source's sample index (model.teacher.precomputed reads them); resumable, splits "
                         "over torchrun ranks")
    te.add_argument("teacher", help="anything vltrain opens: a run, checkpoint, export, Hugging Face folder, "
                    "OpenCLIP file, or a Hub name (hf-hub:ORG/NAME[@REVISION])")
    te.add_argument("sources", nargs="*", help="manifests, shard patterns or parquet files (default: the "
                    "config's data.train)")
    te.add_argument("--config", default=None, help="the training config: its sources, decoding limits and cache")
    te.add_argument("--batch-size", type=int, default=64)
    te.add_argument("--workers", type=int, default=2, help="loader processes decoding images (default 2)")
    te.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                    help="the teacher's precision (default: the config's train.precision, else fp32)")
    te.add_argument("--dtype", choices=["float16", "float32"], default="float16",
                    help="how the embeddings are stored (float16 rounds less than bf16 does; default)")
    te.add_argument("--device", default="auto", help="auto, cpu or cuda")
    te.add_argument("--chunk-rows", type=int, default=1024, help="rows per unit of work and of resumption")
    te.set_defaults(func=teacher_embed)


def _add_shard_parser(dsub) -> None:
    sh = dsub.add_parser("shard", help="write img2dataset-style tar shards (or Hub-style parquet) from a source")
    sh.add_argument("manifest", metavar="SOURCE", help="a manifest, a tar shard pattern or parquet files")
    sh.add_argument("--out", required=True)
    sh.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard or parquet file")
    sh.add_argument("--format", choices=("tar", "parquet"), default="tar",
                    help="tar: KEY.jpg/txt/json shards; parquet: train-0000K-of-0000N.parquet, Hub layout")
    sh.add_argument("--image-size", type=int, default=0,
                    help="resize images to this shorter side, aspect kept, as JPEG (0: copy them unchanged)")
    sh.add_argument("--quality", type=int, default=95, help="JPEG quality of resized images (default 95)")
    sh.add_argument("--row-group", type=int, default=100, help="rows per parquet row group (default 100)")
    sh.set_defaults(func=shard)


def _add_coco_parser(dsub) -> None:
    c = dsub.add_parser("from-coco", help="a JSONL manifest with regions from COCO-style annotations "
                        "(instances, RefCOCO-style refs, captions)")
    c.add_argument("--instances", required=True, help="COCO's instances_*.json: images, annotations, categories")
    c.add_argument("--images", required=True, help="the folder of the images the instances name")
    c.add_argument("--out", required=True, help="the manifest (.jsonl) to write")
    c.add_argument("--refs", default=None, help="referring phrases: a JSON list of {image_id, ann_id, "
                   "sentences: [{sent}], split} (RefCOCO's refs as JSON); objects without one are named by category")
    c.add_argument("--captions", default=None, help="COCO's captions_*.json: a caption per row")
    c.add_argument("--split", default="", help="only the refs of this split (train, val, testA, ...) and their images")
    c.add_argument("--all-captions", action="store_true",
                   help="a row per caption, sharing the image's id (default: the image's first caption)")
    c.set_defaults(func=from_coco)


def from_coco(args: argparse.Namespace) -> int:
    """``vltrain data from-coco --instances F --images DIR --out M [--refs F] [--captions F] [--split S]``."""
    from vltrain.data.tools.coco import from_coco as convert

    r = convert(args.instances, args.images, args.out, args.refs, args.captions, args.split, args.all_captions)
    print(f"wrote {r.rows} rows ({r.images} images) to {args.out}: {r.referring + r.named} regions, {r.referring} "
          f"with a referring phrase and {r.named} named by their category; {r.captions} captions read")
    print(f"left out {r.crowd} crowd annotation(s) and {r.empty} box(es) with no area in their image; clipped "
          f"{r.clipped} box(es) to their image")
    print(f"next: vltrain data validate {args.out}")
    return 0


def synth(args: argparse.Namespace) -> int:
    from vltrain.data.tools.synth import KINDS, TOKENIZER_VOCAB, synthesize, synthesize_classify, write_tokenizer
    from vltrain.errors import UserError

    if args.classify:
        out = synthesize_classify(args.classify, args.per_class, args.seed, args.image_size, args.workers)
        print(f"classify: {out} ({len(KINDS)} classes x {args.per_class} images: {', '.join(KINDS)})")
        print(f"templates: {out / 'templates.txt'}")
        print(f"next: vltrain eval RUN_DIR --zeroshot {out} --templates {out / 'templates.txt'}")
        if not args.out:
            return 0
    if not args.out:
        raise UserError("give --out DIR (image-text pairs) and/or --classify DIR (a class-per-folder set)")
    paths = synthesize(
        args.out, args.num, args.val, args.text_only_fraction, args.seed, args.image_size, args.workers,
        image_only_fraction=args.image_only_fraction, with_regions=args.regions, long_captions=args.long_captions, with_masks=args.masks,
    )
    for split, p in paths.items():
        print(f"{split}: {p}")
    if args.masks:
        print(f"dense: {Path(args.out) / 'dense.jsonl'} (masks of the val images; next: vltrain eval RUN_DIR "
              f"--dense {Path(args.out) / 'dense.jsonl'})")
    tokenizer = write_tokenizer(args.out)
    print(f"tokenizer: {tokenizer} (BPE, {TOKENIZER_VOCAB} tokens, trained on the training captions)")
    longer = " data.max_text_length=160" if args.long_captions else ""
    print(f"next: vltrain train configs/demo.yaml data.train={paths['train']} data.val={paths['val']} "
          f"data.tokenizer={tokenizer}{longer}")
    return 0


def validate(args: argparse.Namespace) -> int:
    """Exit 0 clean, 1 when problems were found."""
    from dataclasses import asdict

    from vltrain.data.tools.validate import validate as validate_sources

    summaries = validate_sources(args.sources, args.workers, progress=not args.json and sys.stderr.isatty())
    errors = sum(s.errors for s in summaries)
    if args.json:
        out = []
        for s in summaries:
            d = asdict(s)
            d["problems"] = [asdict(p) for p in s.problems[: args.max_problems]]
            out.append(d)
        print(json.dumps({"ok": errors == 0, "sources": out}, indent=1, ensure_ascii=False))
        return 1 if errors else 0
    for s in summaries:
        print(
            f"{s.name}: {s.rows} rows ({s.image_text} image-text, {s.text_only} text-only, "
            f"{s.image_only} image-only); {s.errors} error(s), {s.warnings} warning(s)"
        )
        ordered = [p for p in s.problems if p.level == "error"] + [p for p in s.problems if p.level != "error"]
        for p in ordered[: args.max_problems]:
            print(f"  {p.level}: {p}")
        if len(ordered) > args.max_problems:
            print(f"  ... and {len(ordered) - args.max_problems} more (--max-problems, --json)")
    print("ok" if errors == 0 else f"{errors} problem(s) found")
    return 1 if errors else 0


def stats(args: argparse.Namespace) -> int:
    from vltrain.data.tools.validate import PERCENTILES
    from vltrain.data.tools.validate import stats as source_stats

    report = source_stats(args.sources, args.tokenizer, args.max_images)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    n = max(report["rows"], 1)
    print(f"rows: {report['rows']}")
    for k in ("image_text", "text_only", "image_only"):
        print(f"  {k.replace('_', '-'):<11} {report[k]:>10}  {100 * report[k] / n:5.1f}%")
    cap = report["caption_length"]
    header = "".join(f"{k:>8}" for k in [*(f"p{q}" for q in PERCENTILES), "mean", "max"])
    print(f"{'':<24}{header}")
    rows = [(f"caption ({cap['unit']})", cap), ("image width", report["image_width"]),
            ("image height", report["image_height"])]
    for name, d in rows:
        print(f"{name:<24}" + "".join(f"{d.get(k, float('nan')):>8.1f}" for k in [*(f"p{q}" for q in PERCENTILES), "mean", "max"]))
    print(f"images measured: {report['images_measured']} (unreadable: {report['images_unreadable']})")
    for d in report["damaged"]:
        print(f"damaged: {d['where']}: {d['reason']}")
    return 0


def index(args: argparse.Namespace) -> int:
    """``vltrain data index SOURCES... [--tokenizer T] [--image-sizes]``: build (or find) each source's
    sample index, with a tokenizer its caption token counts, and with ``--image-sizes`` its images' sizes.

    Exit 0 clean, 1 when rows were dropped as malformed (they are listed in the index's
    problems.jsonl), 2 on a usage error."""
    from vltrain.config.job import load_config
    from vltrain.data.config import CsvConfig
    from vltrain.data.index.build import source_files
    from vltrain.data.index.open import open_indexed
    from vltrain.data.tokenizers import load_tokenizer
    from vltrain.errors import DataError, UsageError
    from vltrain.runtime.cpus import usable_cpus

    tokenizer_path, max_len, csv_cfg, cache_dir = args.tokenizer, args.max_text_length, CsvConfig(), args.cache_dir
    storage_options, cache_limit_gb, retries = None, 50.0, 2
    if args.config:
        cfg = load_config(args.config)
        tokenizer_path = tokenizer_path or cfg.data.tokenizer
        max_len = max_len or cfg.data.max_text_length
        csv_cfg, cache_dir = cfg.data.csv, cache_dir or cfg.data.cache_dir
        storage_options, cache_limit_gb = cfg.data.storage_options, cfg.data.cache_limit_gb
        retries = cfg.data.remote_retries
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    workers = args.workers or usable_cpus()
    dropped = 0
    for spec in args.sources:
        try:
            source_files(spec, storage_options)
        except DataError as e:
            raise UsageError(str(e)) from None  # a source that is not there: the command was misused
        started = time.monotonic()
        source = open_indexed(spec, tokenizer, max_len or 77, csv_cfg, cache_dir or None, workers=workers,
                              storage_options=storage_options, cache_limit_gb=cache_limit_gb, retries=retries)
        took = time.monotonic() - started
        _index_report(spec, source, took, tokenizer is not None)
        if args.image_sizes:
            _sizes_report(source, workers)
        dropped += source.meta["errors"]
    return 1 if dropped else 0


def _index_report(spec: str, source, took: float, with_lengths: bool) -> None:
    meta = source.meta
    how = (f"built in {took:.1f} s ({len(source) / max(took, 1e-9):,.0f} rows/s)"
           if source.built_now else "up to date")
    damaged = source.damaged
    lost = f"{len(damaged)} damaged file(s) or row group(s) ({sum(d['lost'] for d in damaged)} samples lost), " \
        if damaged else ""
    print(f"{spec}: {len(source):,} samples, {lost}{meta['errors'] - len(damaged)} malformed row(s) dropped, "
          f"{meta['warnings']} warning(s); index {how}\n  {source.index_dir}")
    if with_lengths:
        had = source.lengths_at_hand() is not None
        started = time.monotonic()
        source.text_len()
        took = time.monotonic() - started
        print("  token counts " + ("up to date" if had else
                                   f"made in {took:.1f} s ({len(source) / max(took, 1e-9):,.0f} captions/s)"))
    else:
        print("  token counts: not made (give --tokenizer; budget batching makes them on first use)")
    for d in damaged[:5]:
        print(f"  damaged {d['where']}: {d['reason']}")
    for p in [p for p in source.errors() if p.where not in {d["where"] for d in damaged}][:5]:
        print(f"  dropped {p}")


def _sizes_report(source, workers: int) -> None:
    import numpy as np

    from vltrain.data.index.sizes import SIZES_FILE, image_sizes

    had = (source.index_dir / SIZES_FILE).is_file()
    started = time.monotonic()
    sizes = image_sizes(source, workers=workers)
    took = time.monotonic() - started
    images = int(np.asarray(source.has_image()).sum())
    unread = images - int((np.asarray(sizes)[:, 0] > 0).sum())
    print("  image sizes " + ("up to date" if had else f"read in {took:.1f} s ({images / max(took, 1e-9):,.0f} images/s)")
          + (f"; {unread} image(s) whose header cannot be read (bad samples when loaded)" if unread else ""))


def shard(args: argparse.Namespace) -> int:
    """``vltrain data shard SOURCE --out DIR [--shard-size N] [--format tar|parquet] [--image-size N
    --quality Q]``; exit 1 if rows had to be skipped."""
    from vltrain.data.index.open import open_any
    from vltrain.data.sources.manifests import open_manifest
    from vltrain.data.sources.parquet import is_parquet
    from vltrain.data.sources.patterns import is_shard_pattern
    from vltrain.data.sources.shards import ShardSource, write_shards
    from vltrain.data.tools.convert import resizer, write_parquet
    from vltrain.errors import UserError

    if args.shard_size < 1 or args.row_group < 1:
        raise UserError(f"--shard-size and --row-group must be >= 1, got {args.shard_size} and {args.row_group}")
    transform = resizer(args.image_size, args.quality) if args.image_size else None
    source = ShardSource(args.manifest) if is_shard_pattern(args.manifest) else \
        open_any(args.manifest) if is_parquet(args.manifest) else open_manifest(args.manifest)
    if args.format == "parquet":
        written, not_copied = write_parquet(source, args.out, args.shard_size, args.row_group, transform)
        pattern = f"{args.out}/train-*-of-{len(written):05d}.parquet"
    else:
        written, not_copied = write_shards(source, args.out, args.shard_size, transform)
        pattern = f"{args.out}/{{00000..{len(written) - 1:05d}}}.tar" if written else "(none)"
    n = len(source) - len(not_copied)
    skipped = source.errors() + not_copied
    print(f"wrote {n} samples in {len(written)} {'file' if args.format == 'parquet' else 'shard'}(s): {pattern}")
    for p in skipped[:20]:
        print(f"  skipped {p}", file=sys.stderr)
    if skipped:
        print(f"{len(skipped)} row(s) skipped", file=sys.stderr)
    return 1 if skipped else 0


def audit(args: argparse.Namespace) -> int:
    from vltrain.data.loading.audit import audit_run

    report = audit_run(args.run_dir)
    print(
        f"audit of {args.run_dir}: {report.epochs} epoch(s), {report.complete_epochs} complete, "
        f"{report.batches} batches, {report.samples} samples, {report.replaced} bad-sample replacements"
    )
    for p in report.problems:
        print(f"  PROBLEM: {p}")
    print("OK: no duplicates, nothing lost beyond the documented drop, ranks disjoint" if report.ok
          else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def teacher_embed(args: argparse.Namespace) -> int:
    """``vltrain data teacher-embed TEACHER [SOURCES...] [--config C]``: this rank's share of every
    source's teacher embeddings; one line per source, for the whole world (rank 0)."""
    from vltrain.config.job import load_config
    from vltrain.data.dataset import source_specs
    from vltrain.errors import UsageError
    from vltrain.train.teacher_embed import teacher_embed as embed

    if args.chunk_rows < 1 or args.batch_size < 1:
        raise UsageError("--chunk-rows and --batch-size must be >= 1")
    cfg = load_config(args.config) if args.config else None
    sources = args.sources or ([s.path for s in source_specs(cfg.data.train)] if cfg is not None else [])
    if not sources:
        raise UsageError("give the sources to embed, or --config with data.train")
    precision = args.precision or (cfg.train.precision if cfg is not None else "fp32")
    passes = embed(args.teacher, sources, cfg, precision=precision, device=args.device, batch_size=args.batch_size,
                   workers=args.workers, dtype=args.dtype, chunk=args.chunk_rows)
    if int(os.environ.get("RANK", "0")) == 0:
        for p in passes:
            rate = p.rows_now / max(p.seconds, 1e-9)
            print(f"{p.source}: {p.rows:,} rows in {p.chunks} chunks; embedded {p.done_now} chunk(s) "
                  f"({p.rows_now:,} rows, {p.done_before} chunk(s) done before) in {p.seconds:.1f} s ({rate:,.0f} "
                  "rows/s); "
                  f"{p.unreadable} row(s) the teacher could not read, stored as missing (training replaces those "
                  f"samples; run this again once they are readable); filled {p.filled} row(s) missing before\n"
                  f"  {p.folder}")
    return 0


def train_tokenizer(args: argparse.Namespace) -> int:
    """``vltrain tokenizer train SOURCES --out FILE --vocab-size N --kind bpe|wordpiece``."""
    from vltrain.data.tokenizers import SPECIAL_TOKENS
    from vltrain.data.tools.tokenizer_training import source_texts
    from vltrain.data.tools.tokenizer_training import train_tokenizer as train
    from vltrain.errors import UserError

    if args.vocab_size < len(SPECIAL_TOKENS) + 1:
        raise UserError(f"--vocab-size must be more than {len(SPECIAL_TOKENS)}, got {args.vocab_size}")
    texts = list(source_texts(args.sources))
    if not texts:
        raise UserError(f"no texts found in {', '.join(args.sources)}")
    tok = train(texts, args.out, vocab_size=args.vocab_size, kind=args.kind)
    print(f"wrote {tok.path}: {args.kind}, vocabulary {tok.vocab_size}, trained on {len(texts)} texts")
    return 0


def openclip_tokenizer(args: argparse.Namespace) -> int:
    """``vltrain tokenizer from-openclip [VOCAB] --out FILE``."""
    from pathlib import Path

    from vltrain.data.tools.openclip_tokenizer import openclip_tokenizer as build

    tok = build(args.vocab)
    out = Path(args.out)
    out = out / "tokenizer.json" if out.is_dir() else out
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    print(f"wrote {out}: OpenCLIP's BPE, vocabulary {tok.get_vocab_size()}. It gives open_clip's ids once captions "
          "are cleaned as OpenCLIP cleans them: data.text_clean=clip (set by model.init of an OpenCLIP checkpoint)")
    return 0
