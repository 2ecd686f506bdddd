"""Evaluation: image->text and text->image recall@1/5/10 on held-out pairs (``data.val``), and the
sets of ``eval.zeroshot`` (:mod:`vltrain.eval.zeroshot`) and ``eval.retrieval`` (:mod:`vltrain.eval.retrieval`),
each with ITM re-ranking for fusion models, the caption sets of ``eval.captions``
(:mod:`vltrain.eval.captioning`) and the referring-expression sets of ``eval.referring``
(:mod:`vltrain.eval.grounding`) and the
dense sets of ``eval.dense`` (:mod:`vltrain.eval.dense`); ``eval.json``; ``vltrain eval``.

Every rank embeds its shard of each set, the embeddings are gathered, and every rank
computes the same metrics. Nobody waits at a barrier while rank 0 works alone (the way
evaluation times out the other ranks' collectives in some trainers).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vltrain.checkpoint.paths import IMPORTED, locate
from vltrain.compose.builders import build_task, build_val_loader
from vltrain.compose.decide import model_config
from vltrain.compose.opening import open_model
from vltrain.config.job import JobConfig
from vltrain.data.dataset import source_specs
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import ConfigError, UserError
from vltrain.eval.captioning import evaluate_captions, open_caption_set
from vltrain.eval.dense import evaluate_dense, open_dense
from vltrain.eval.grounding import evaluate_referring, open_referring
from vltrain.eval.embedding import Embedded, Encoder, cat_padded, eval_mode
from vltrain.eval.retrieval import evaluate_retrieval, itm_rerank, multi_caption_recall, open_retrieval
from vltrain.eval.zeroshot import evaluate_zeroshot, open_zeroshot
from vltrain.model.passes import Encode
from vltrain.runtime.distributed import World, all_gather_no_grad
from vltrain.runtime.precision import Precision
from vltrain.model.builder import has_decoder
from vltrain.model.generate import Decoding
from vltrain.runtime.world import setup_world

log = logging.getLogger(__name__)

KS = (1, 5, 10)


def recall_at_k(query: torch.Tensor, keys: torch.Tensor, ks: tuple[int, ...] = KS, chunk: int = 4096) -> dict[int, float]:
    """Query i's correct key is key i. A query counts at k when fewer than k other keys score
    at least as high as the correct one: ties count against, so a collapsed model scores 0."""
    n = query.shape[0]
    hits = {k: 0 for k in ks}
    for lo in range(0, n, chunk):
        q = query[lo : lo + chunk].float()
        sims = q @ keys.float().T
        idx = torch.arange(lo, lo + q.shape[0], device=sims.device)
        correct = sims[torch.arange(q.shape[0], device=sims.device), idx].unsqueeze(1)
        rank = (sims >= correct).sum(dim=1) - 1
        for k in ks:
            hits[k] += int((rank < k).sum())
    return {k: hits[k] / max(n, 1) for k in ks}


def retrieval_metrics(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> dict[str, float]:
    """Row i of each is one pair. Keys: ``i2t_r1 .. t2i_r10``, ``mean_recall``, ``num_pairs``."""
    i2t = recall_at_k(image_embeds, text_embeds)
    t2i = recall_at_k(text_embeds, image_embeds)
    out: dict[str, float] = {}
    for k in KS:
        out[f"i2t_r{k}"] = i2t[k]
    for k in KS:
        out[f"t2i_r{k}"] = t2i[k]
    out["mean_recall"] = (sum(i2t.values()) + sum(t2i.values())) / (2 * len(KS))
    out["num_pairs"] = int(image_embeds.shape[0])
    return out


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's rows (shards may differ in length)."""
    return all_gather_no_grad(x)


@dataclass
class Pairs:
    """This rank's image-text pairs of the val set, or every rank's once gathered."""

    images: Embedded
    texts: Embedded
    ids: torch.Tensor
    source: torch.Tensor
    """The index of each pair's source in ``data.val``."""

    def gathered(self) -> "Pairs":
        return Pairs(self.images.gathered(), self.texts.gathered(), gather_rows(self.ids), gather_rows(self.source))

    def select(self, rows: torch.Tensor) -> "Pairs":
        def pick(e: Embedded) -> Embedded:
            return Embedded(e.embeds[rows], e.present[rows], None if e.tokens is None else e.tokens[rows],
                            None if e.mask is None else e.mask[rows])

        return Pairs(pick(self.images), pick(self.texts), self.ids[rows], self.source[rows])


@torch.no_grad()
def embed_pairs(encoder: Encoder, loader, keep_tokens: bool = False) -> Pairs:
    """This rank's image-text pairs (rows missing either side are skipped), with their tokens for
    ITM re-ranking when ``keep_tokens``."""
    parts: list[Pairs] = []
    for batch in loader:
        inputs = batch.to_model_inputs(encoder.device, encoder.data_cfg.mean, encoder.data_cfg.std)
        keep = inputs.has_image & inputs.has_text
        with encoder.autocast():
            enc = encoder.wrapped(Encode(inputs))
        images = Embedded(enc.image_embeds[keep].float(), keep[keep])
        texts = Embedded(enc.text_embeds[keep].float(), keep[keep])
        if keep_tokens:
            images.tokens, texts.tokens, texts.mask = enc.image_tokens[keep], enc.text_tokens[keep], inputs.attention_mask[keep]
        parts.append(Pairs(images, texts, inputs.ids[keep], inputs.source[keep]))
    return _cat_pairs(parts)


def _cat_pairs(parts: list[Pairs]) -> Pairs:
    def cat(side: str, field: str):
        xs = [getattr(getattr(p, side), field) for p in parts]
        return None if xs[0] is None else cat_padded(xs)

    sides = {side: Embedded(*(cat(side, f) for f in ("embeds", "present", "tokens", "mask"))) for side in ("images", "texts")}
    return Pairs(sides["images"], sides["texts"], torch.cat([p.ids for p in parts]), torch.cat([p.source for p in parts]))


def evaluate(encoder: Encoder, loader, *, rerank_k: int = 0, batch_size: int = 256,
             source_names: list[str] | None = None) -> dict[str, float]:
    """Retrieval metrics over the val set (one caption per image); the same dict on every rank.
    With ``rerank_k`` (fusion models), also the ITM re-ranked recalls, as ``itm_i2t_r1`` ...; with
    several ``source_names`` (``data.val`` lists several sources), each source's own recalls too, as
    ``val/NAME/t2i_r1`` ... (each source's pairs searched among themselves)."""
    with eval_mode(encoder.wrapped):
        pairs = embed_pairs(encoder, loader, keep_tokens=bool(rerank_k))
    pairs = pairs.gathered()
    # an evenly split val set repeats a few samples on some ranks; count each pair once
    order = torch.argsort(pairs.ids, stable=True)
    ids = pairs.ids[order]
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    keep = order[first]
    pairs = pairs.select(keep)
    out = retrieval_metrics(pairs.images.embeds, pairs.texts.embeds)
    for s, name in enumerate(source_names if source_names and len(source_names) > 1 else []):
        mine = pairs.source == s
        if mine.any():
            per = retrieval_metrics(pairs.images.embeds[mine], pairs.texts.embeds[mine])
            out.update({f"val/{name}/{k}": v for k, v in per.items()})
    if rerank_k and len(keep):
        one_each = torch.arange(len(keep), device=pairs.images.embeds.device)
        rescored = itm_rerank(encoder.wrapped, pairs.images, pairs.texts, rerank_k, batch_size, encoder.autocast)
        out.update(multi_caption_recall(pairs.images.embeds, pairs.texts.embeds, one_each, rescored, prefix="itm_"))
    return out


class Evaluator:
    """Every evaluation a config names (``data.val``, ``eval.zeroshot``, ``eval.retrieval``), each set
    opened once; :meth:`run` evaluates them all on every rank and returns one flat dict."""

    def __init__(self, cfg: JobConfig, tokenizer: Tokenizer, world: World, run_dir: Path | None = None):
        self.cfg = cfg
        ec, kw = cfg.eval, {"rank": world.rank, "world_size": world.world_size, "batch_size": cfg.eval.batch_size}
        self.val = build_val_loader(cfg, tokenizer, world, run_dir) if cfg.data.val else None
        self.zeroshot = [open_zeroshot(z.name, z.path, z.templates, cfg.data, tokenizer, **kw) for z in ec.zeroshot]
        self.retrieval = [open_retrieval(r.name, r.path, r.split, r.image_root, cfg.data, tokenizer, **kw)
                          for r in ec.retrieval]
        if ec.captions and not has_decoder(cfg.model.architecture(), cfg.model.loss):
            raise ConfigError("eval.captions needs a captioning decoder: a preset with one (tiny-coca, coca-vit-b32) "
                              "and model.loss.caption > 0")
        self.tokenizer = tokenizer
        self.kw = kw
        if ec.referring and not getattr(cfg.model.architecture().decoder, "standalone", False):
            raise ConfigError("eval.referring needs a LocCa decoder: a preset with one (tiny-siglip2, siglip2-vit-b16)")
        self.referring = [open_referring(r.name, r.path, r.image_root) for r in ec.referring]
        self.dense = [open_dense(d.name, d.path, d.image_root) for d in ec.dense]
        arch = cfg.model.architecture()
        # a LocCa decoder starts at its own caption task token (the prompt's start is not read)
        start = (0 if arch.decoder is not None and arch.decoder.standalone else arch.text.start_id) if ec.captions else None
        self.captions = [open_caption_set(c.name, c.path, c.split, c.image_root, cfg.data, tokenizer,
                                          Decoding(c.max_length or cfg.data.max_text_length, c.beam), c.prompt, **kw,
                                          start_id=start)
                         for c in ec.captions]

    def __bool__(self) -> bool:
        return self.val is not None or any((self.zeroshot, self.retrieval, self.captions, self.referring, self.dense))

    def run(self, wrapped: nn.Module, model: nn.Module, device: torch.device, autocast) -> dict[str, float]:
        ec, data = self.cfg.eval, self.cfg.data
        rerank_k = ec.itm_rerank_k if getattr(model, "itm_head", None) is not None else 0
        out: dict[str, float] = {}
        encoder = Encoder(wrapped, data, device, autocast)
        if self.val is not None:
            names = [s.display_name() for s in source_specs(data.val)]
            out.update(evaluate(encoder, self.val, rerank_k=rerank_k,
                                batch_size=ec.batch_size, source_names=names))
        for z in self.zeroshot:
            out.update(evaluate_zeroshot(encoder, z))
        for r in self.retrieval:
            out.update(evaluate_retrieval(encoder, r, rerank_k, ec.batch_size))
        for c in self.captions:
            out.update(evaluate_captions(encoder, c, self.tokenizer))
        for r in self.referring:
            out.update(evaluate_referring(encoder, self.tokenizer, r, **self.kw))
        for d in self.dense:
            out.update(evaluate_dense(encoder, model, d, **self.kw))
        return out


def check_early_stop_metric(metric: str, metrics: dict[str, float]) -> None:
    if metric and metric not in metrics:
        raise ConfigError(f"eval.early_stop_metric {metric!r} is not among the evaluation's metrics: "
                          + ", ".join(k for k in metrics if not k.rsplit("/", 1)[-1].startswith("num_")))


EVAL_DECIMALS = 6


def rounded(metrics: dict[str, float]) -> dict[str, float]:
    """Every fraction rounded alike (eval.json, ``vltrain eval --json``): a recall of 1 in 25,000
    stays, float noise goes."""
    return {k: round(v, EVAL_DECIMALS) if isinstance(v, float) else v for k, v in metrics.items()}


def append_eval(run_dir: str | Path, step: int, metrics: dict[str, float]) -> None:
    """RUN_DIR/eval.json: a list of {"step": N, metrics...}, newest last."""
    path = Path(run_dir) / "eval.json"
    history = json.loads(path.read_text()) if path.exists() else []
    history = [h for h in history if h.get("step") != step] + [{"step": step, **rounded(metrics)}]
    path.write_text(json.dumps(history, indent=1) + "\n")


def format_metrics(m: dict[str, float]) -> str:
    """One line: the val recalls (and re-ranked ones) with the pairs they were measured on, then each
    set's headline figure with its images (a recall on 3 pairs is not a recall on 3,000)."""
    keys = [f"{p}{d}_r{k}" for p in ("", "itm_") for d in ("i2t", "t2i") for k in KS]
    parts = [f"{k}={m[k]:.3f}" for k in keys if k in m]
    if "num_pairs" in m:
        parts.append(f"[{int(m['num_pairs']):,} pairs]")
    for k, v in m.items():
        if (k.startswith(("zeroshot/", "retrieval/")) and k.endswith(("/top1", "/t2i_r1", "/itm_t2i_r1"))
                or k.startswith("captions/") and k.endswith("/cider") or k.startswith("dense/") and k.endswith("/miou")):
            images = m.get(f"{k.rsplit('/', 1)[0]}/num_images")
            parts.append(f"{k}={v:.3f}" + ("" if images is None or k.endswith("/itm_t2i_r1")
                                           else f" [{int(images):,} images]"))
    averaged = {k[len("ema/"):]: v for k, v in m.items() if k.startswith("ema/")}
    if averaged:  # train.ema: the averaged weights on the same sets
        parts.append(f"| ema: {format_metrics(averaged)}")
    return "  ".join(parts)


def format_table(m: dict[str, float]) -> str:
    """A table with a row per evaluated set (and re-ranking) and a column per metric."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in m.items():
        head, _, metric = key.rpartition("/")
        if metric.startswith("itm_"):
            head, metric = f"{head or 'val'} (ITM re-ranked)", metric[4:]
        rows.setdefault(head or "val", {})[metric] = value
    lines = []
    for name, row in rows.items():
        cols = list(row)
        lines.append(f"{name}")
        lines.append("  " + "  ".join(f"{c:>14}" for c in cols))
        lines.append("  " + "  ".join(f"{row[c]:>14.4f}" if isinstance(row[c], float) else f"{row[c]:>14}"
                                      for c in cols))
    return "\n".join(lines)


def evaluate_run(path: Path, data: str | None = None, overrides: list[str] | None = None,
                 val: bool = True, ema: bool = False) -> dict[str, float]:
    """Metrics of any model vltrain opens (``vltrain eval``: a run's latest checkpoint, a checkpoint,
    an export, a Hugging Face folder or an OpenCLIP file; :mod:`vltrain.compose.opening`): its
    ``data.val`` (unless ``val`` is false) and its ``eval.zeroshot``, ``eval.retrieval`` and
    ``eval.captions`` sets;
    ``ema``: a run's EMA weights (``train.ema``)."""
    found = locate(path)
    asked = ["data.val=''"] if not val else [f"data.val={data}"] if data else []
    decided = model_config(found, list(overrides or []) + asked)
    cfg = decided.cfg
    if not (cfg.data.val or cfg.eval.zeroshot or cfg.eval.retrieval or cfg.eval.captions or cfg.eval.referring
            or cfg.eval.dense):
        raise UserError(f"{path} names no data.val and no eval sets; pass --data VAL_MANIFEST, "
                        "--zeroshot DIR, --retrieval FILE, --captions FILE, --referring FILE or --dense FILE")
    world = setup_world(timeout_s=cfg.train.timeout_s, device=cfg.train.device, threads=cfg.train.threads,
                        tf32=cfg.train.tf32)
    clean = False
    try:
        opened = open_model(decided, device=world.device, ema=ema)
        evaluator = Evaluator(cfg, opened.tokenizer, world)
        precision = Precision(cfg.train.precision, world.device)
        if world.is_main:
            why = ("an imported checkpoint: fp32 unless train.precision says otherwise" if found.kind in IMPORTED
                   else "the run's train.precision")
            log.info(f"evaluating {path}{' (its EMA weights)' if ema else ''} in {cfg.train.precision} ({why}) "
                     f"on {world.world_size} rank(s)")
        metrics = evaluator.run(build_task(cfg, opened.model), opened.model, world.device, precision.autocast)
        clean = True
        return metrics
    finally:
        world.close(clean)
