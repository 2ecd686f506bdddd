"""Zero-shot retrieval: image->text and text->image recall@1/5/10 on held-out pairs.

Every rank embeds its shard of the val set, the embeddings are gathered, and every rank
computes the same metrics. Nobody waits at a barrier while rank 0 works alone (the way
evaluation times out the other ranks' collectives in some trainers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from vltrain.build import build_model_for, build_task, build_tokenizer, build_val_loader
from vltrain.checkpoint import find_checkpoint, load_model_weights
from vltrain.config import load_config
from vltrain.distributed import all_gather_no_grad, all_reduce_sum
from vltrain.errors import UserError
from vltrain.export import is_exported, load_exported
from vltrain.precision import Precision
from vltrain.runtime import setup_world

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


@torch.no_grad()
def embed_pairs(wrapped: nn.Module, loader, data_cfg, device: torch.device, autocast, max_samples: int = 0):
    """Embeddings and ids of this rank's image-text pairs (rows missing either side are skipped).

    With ``max_samples``, stops once all ranks together hold that many pairs (or more)."""
    imgs, txts, ids = [], [], []
    seen = 0
    for batch in loader:
        inputs = batch.to_model_inputs(device, data_cfg.mean, data_cfg.std)
        keep = inputs.has_image & inputs.has_text
        with autocast():
            enc = wrapped("encode", inputs)
        imgs.append(enc.image_embeds[keep].float())
        txts.append(enc.text_embeds[keep].float())
        ids.append(inputs.ids[keep])
        # every rank stops after the same batch (FSDP2 gathers parameters in each forward), once
        # the ranks together hold max_samples pairs
        if max_samples:
            seen += int(all_reduce_sum(keep.sum()))
            if seen >= max_samples:
                break
    return torch.cat(imgs), torch.cat(txts), torch.cat(ids)


def evaluate(wrapped: nn.Module, loader, data_cfg, device: torch.device, autocast, max_samples: int = 0) -> dict[str, float]:
    """Retrieval metrics over the val set; the same dict on every rank."""
    was_training = wrapped.training
    wrapped.eval()
    try:
        img, txt, ids = embed_pairs(wrapped, loader, data_cfg, device, autocast, max_samples)
    finally:
        wrapped.train(was_training)
    img, txt, ids = gather_rows(img), gather_rows(txt), gather_rows(ids)
    # an evenly split val set repeats a few samples on some ranks; count each pair once
    order = torch.argsort(ids, stable=True)
    ids = ids[order]
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    keep = order[first]
    if max_samples:
        keep = keep[:max_samples]
    return retrieval_metrics(img[keep], txt[keep])


def append_eval(run_dir: str | Path, step: int, metrics: dict[str, float]) -> None:
    """RUN_DIR/eval.json: a list of {"step": N, metrics...}, newest last."""
    path = Path(run_dir) / "eval.json"
    history = json.loads(path.read_text()) if path.exists() else []
    history = [h for h in history if h.get("step") != step] + [{"step": step, **metrics}]
    path.write_text(json.dumps(history, indent=1) + "\n")


def format_metrics(m: dict[str, float]) -> str:
    keys = [f"i2t_r{k}" for k in KS] + [f"t2i_r{k}" for k in KS]
    return "  ".join(f"{k}={m[k]:.3f}" for k in keys if k in m)


def eval_cli(args: argparse.Namespace) -> int:
    """``vltrain eval RUN_DIR``: retrieval metrics of the run's weights on its (or another) val set."""
    metrics = evaluate_run(Path(args.path), data=args.data, overrides=list(args.overrides or []))
    print(json.dumps(metrics, indent=1))
    return 0


def evaluate_run(run_dir: Path, data: str | None = None, overrides: list[str] | None = None) -> dict[str, float]:
    """Retrieval metrics of a run's latest checkpoint or of an exported model (``vltrain eval``)."""
    exported = is_exported(run_dir)
    config_path = run_dir / "config.yaml"
    if not exported and not config_path.exists():
        raise UserError(f"{run_dir} is neither a run folder (with config.yaml and checkpoints) "
                        "nor an exported model (vltrain export)")
    cfg = load_config(config_path, list(overrides or []) + ([f"data.val={data}"] if data else []))
    ckpt = None if exported else find_checkpoint(run_dir, cfg.checkpoint.folder)
    if not cfg.data.val:
        raise UserError(f"{config_path} names no data.val; pass --data VAL_MANIFEST")
    world = setup_world(timeout_s=cfg.train.timeout_s, device=cfg.train.device, threads=cfg.train.threads,
                        tf32=cfg.train.tf32)
    clean = False
    try:
        if exported:
            model, tokenizer, exported_cfg = load_exported(run_dir, world.device)
            cfg.data.tokenizer = exported_cfg.data.tokenizer
        else:
            tokenizer = build_tokenizer(cfg)
            model = build_model_for(cfg, tokenizer, world.device)
            load_model_weights(ckpt, model)
        loader = build_val_loader(cfg, tokenizer, world)
        precision = Precision(cfg.train.precision, world.device)
        metrics = evaluate(build_task(cfg, model), loader, cfg.data, world.device, precision.autocast, cfg.eval.max_samples)
        clean = True
        return metrics
    finally:
        world.close(clean)
