"""Captions of a list of images, and caption metrics against their references.

Every list goes through :func:`vltrain.data.loading.loader.build_eval_loader`: each rank reads a
contiguous slice, decoded as in training (square or at its own shape), encodes it through the
wrapped task, generates (:mod:`vltrain.model.generate`), and the token ids are gathered in list
order. Generation's passes hold FSDP2's collectives, so the ranks agree at each position whether
every row is finished (one small all-reduce a position when there are several ranks): every rank
makes as many calls.

The metrics are BLEU-4 and CIDEr-D as ``pycocoevalcap`` computes them
(:mod:`vltrain.eval.caption_metrics`), on every rank from the gathered captions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from vltrain.data.config import DataConfig
from vltrain.data.loading.loader import EvalLoader, build_eval_loader
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UsageError, UserError
from vltrain.eval.caption_metrics import caption_scores
from vltrain.eval.captions import open_captions
from vltrain.eval.embedding import Encoder, eval_mode
from vltrain.eval.labeled import ImageListDataset
from vltrain.model.generate import Decoding, generate
from vltrain.model.locca import caption as locca_caption
from vltrain.model.passes import Encode
from vltrain.runtime.distributed import all_gather_no_grad, all_reduce_sum, world_info

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """What generation starts from and stops at, in the model's tokenizer."""

    ids: list[int]
    """The start token, then the prompt's tokens."""
    end_id: int
    pad_id: int

    @staticmethod
    def of(tokenizer: Tokenizer, text: str, max_length: int, start_id: int | None = None) -> "Prompt":
        """``text``'s tokens after the start token (its end token dropped): the model's own
        (``start_id``: BLIP's [DEC], LocCa's caption task token), else the tokenizer's."""
        if (start_id is None and tokenizer.cls_id is None) or tokenizer.eos_id is None:
            raise UserError(f"tokenizer {tokenizer.path or ''} has no start or end token ([CLS]/<s>/<|startoftext|> "
                            "and [SEP]/</s>/<|endoftext|>): a caption needs both")
        ids = [tokenizer.cls_id if start_id is None else start_id]
        if text:
            ids += [t for t in tokenizer.encode(text, 10 * max_length)[0] if t not in (tokenizer.cls_id, tokenizer.eos_id)]
        return Prompt(ids, tokenizer.eos_id, tokenizer.pad_id)


def locca_vocab(model):
    """The vocabulary of ``model``'s LocCa decoder (bare, or in the task that wraps it); None: it has none."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "module", inner)
    return getattr(getattr(inner, "decoder", None), "vocab", None)


def needs_decoder(model, path: str) -> None:
    """One line when ``model`` cannot caption."""
    if getattr(model, "decoder", None) is None:
        raise UserError(f"{path} has no captioning decoder: train a preset with one (tiny-coca, coca-vit-b32) "
                        "with model.loss.caption > 0")


def _agreed(done: torch.Tensor) -> bool:
    """Whether every row of every rank is finished."""
    left = (~done).sum().float()
    if world_info()[1] > 1:
        left = all_reduce_sum(left)
    return bool(left == 0)


@dataclass
class Captions:
    """Every image's caption token ids, in list order (on every rank), and which could be read."""

    ids: list[list[int]]
    present: list[bool]
    errors: list[tuple[str, str]]
    """(path, reason) of this rank's unreadable images."""


@torch.no_grad()
def caption_list(encoder: Encoder, loader: EvalLoader, prompt: Prompt, decoding: Decoding) -> Captions:
    """This rank's images of ``loader`` captioned, then every rank's gathered in list order."""
    rows, present, errors = [], [], {}
    vocab = locca_vocab(encoder.wrapped)
    if vocab is not None and (decoding.beam > 1 or decoding.top_p or len(prompt.ids) > 1):
        raise UsageError("a LocCa decoder captions greedily, without a prompt: leave out --beam, --top-p and --prompt")
    with eval_mode(encoder.wrapped):
        for batch in loader:
            inputs = batch.to_model_inputs(encoder.device, encoder.data_cfg.mean, encoder.data_cfg.std)
            index = torch.arange(len(inputs)) + loader.offset + len(rows)
            with encoder.autocast():
                tokens = encoder.wrapped(Encode(inputs)).image_tokens
                if vocab is not None:  # LocCa's: after its caption task token, greedily
                    rows += locca_caption(encoder.wrapped, vocab, tokens, decoding.max_length, prompt.end_id,
                                          prompt.pad_id)
                else:
                    rows += generate(encoder.wrapped, tokens, prompt.ids, prompt.end_id, prompt.pad_id, decoding,
                                     index=index, all_done=_agreed)
            present += inputs.has_image.tolist()
            errors.update(dict(batch.errors))
    ids, seen = gather_token_rows(rows, present, loader.num_samples, encoder.device)
    return Captions(ids, seen, list(errors.items()))


def gather_token_rows(rows: list[list[int]], present: list[bool], n: int, device: torch.device
                      ) -> tuple[list[list[int]], list[bool]]:
    """This rank's first ``n`` token rows (of any lengths) and whether each image was read, gathered
    from every rank in rank order."""
    width = max([len(r) for r in rows] + [1])
    local = torch.full((n, width), -1, dtype=torch.long, device=device)
    for i, r in enumerate(rows[:n]):
        local[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    ids = all_gather_no_grad(local, pad_value=-1)
    seen = all_gather_no_grad(torch.tensor(present[:n], dtype=torch.bool, device=device))
    return [[t for t in row if t >= 0] for row in ids.tolist()], seen.tolist()


def decode_all(tokenizer: Tokenizer, captions: Captions) -> list[str]:
    """The captions as text (special tokens dropped by the tokenizer's decoder)."""
    return [tokenizer.decode(ids).strip() for ids in captions.ids]


def caption_paths(encoder: Encoder, tokenizer: Tokenizer, paths: list[str], prompt: Prompt, decoding: Decoding, *,
                  rank: int, world_size: int, batch_size: int) -> tuple[list[str], Captions]:
    """Image files captioned (``vltrain caption``, the demo's examples): the texts in list order on
    every rank, and what :func:`caption_list` gives."""
    loader = build_eval_loader(encoder.data_cfg, ImageListDataset(list(paths), encoder.data_cfg), rank=rank,
                               world_size=world_size, batch_size=batch_size, pad_id=tokenizer.pad_id)
    captions = caption_list(encoder, loader, prompt, decoding)
    return decode_all(tokenizer, captions), captions


@dataclass
class CaptionSet:
    """One caption set opened once: each image's reference captions and this rank's image loader."""

    name: str
    references: list[list[str]]
    images: EvalLoader
    decoding: Decoding
    prompt: Prompt


def open_caption_set(name: str, path: str, split: str, image_root: str, data_cfg: DataConfig, tokenizer: Tokenizer,
                     decoding: Decoding, prompt: str, *, rank: int, world_size: int, batch_size: int,
                     start_id: int | None = None) -> CaptionSet:
    """``start_id``: the model's own start token (``TextTowerConfig.start_id``), if it has one."""
    sets = open_captions(path, split, image_root)
    references: list[list[str]] = [[] for _ in sets.images]
    for caption, image in zip(sets.captions, sets.image_of):
        references[image].append(caption)
    opened = Prompt.of(tokenizer, prompt, data_cfg.max_text_length, start_id)
    decoding.check(len(opened.ids), data_cfg.max_text_length)
    images = build_eval_loader(data_cfg, ImageListDataset(sets.images, data_cfg), rank=rank, world_size=world_size,
                               batch_size=batch_size, pad_id=tokenizer.pad_id)
    return CaptionSet(name, references, images, decoding, opened)


def evaluate_captions(encoder: Encoder, task: CaptionSet, tokenizer: Tokenizer) -> dict[str, float]:
    """``captions/NAME/bleu4``, ``cider`` ... on every rank. An unreadable image is left out."""
    captions = caption_list(encoder, task.images, task.prompt, task.decoding)
    texts = decode_all(tokenizer, captions)
    keep = [i for i, ok in enumerate(captions.present) if ok]
    prefix = f"captions/{task.name}/"
    if not keep:
        raise UserError(f"eval.captions {task.name}: none of its {len(texts)} images could be read "
                        f"(first: {captions.errors[0][0] if captions.errors else '?'}); check image_root")
    scores = caption_scores({i: task.references[i] for i in keep}, {i: texts[i] for i in keep})
    out = {f"{prefix}{k}": v for k, v in scores.items()}
    out.update({f"{prefix}num_images": len(keep), f"{prefix}num_unreadable": len(texts) - len(keep)})
    return out


def caption_images(path: Path, images: list[str], overrides: list[str], *, beam: int = 1, top_p: float = 0.0,
                   seed: int = 0, max_length: int = 0, prompt: str = "", batch_size: int = 32, cache: bool = True
                   ) -> list[tuple[str, str | None]]:
    """``vltrain caption``: (path, caption) of each image, in order, on every rank; None for an image
    that could not be read (its reason is logged, with the count)."""
    from vltrain.checkpoint.paths import locate
    from vltrain.compose.decide import model_config

    decided = model_config(locate(path), overrides, purpose="caption")
    context = decided.cfg.data.max_text_length
    decoding = Decoding(max_length or context, beam, top_p, seed, cache)
    decoding.check(0, context)
    g = open_to_generate(decided)
    world, clean = g.world, False
    try:
        needs_decoder(g.model, str(path))
        vocab = locca_vocab(g.model)
        start_id = vocab.caption if vocab is not None else g.model.text.cfg.start_id
        start = Prompt.of(g.tokenizer, prompt, context, start_id)
        decoding.check(len(start.ids), context)
        texts, captions = caption_paths(g.encoder, g.tokenizer, images, start, decoding, rank=world.rank,
                                        world_size=world.world_size, batch_size=batch_size)
        for image, why in captions.errors:
            log.warning(f"{image}: {why}")
        unread = captions.present.count(False)
        if unread and world.is_main:
            log.warning(f"{unread} of {len(images)} images could not be read: no caption for them")
        clean = True
        return [(p, t if ok else None) for p, t, ok in zip(images, texts, captions.present)]
    finally:
        world.close(clean)


@dataclass
class Generating:
    """A model opened to generate on this rank's world: wrapped in its task (``encoder.wrapped``)."""

    encoder: Encoder
    tokenizer: Tokenizer
    model: object
    world: object
    """Closed by the caller (``world.close(clean)``)."""


def open_to_generate(decided) -> Generating:
    """The model a decided config (``vltrain.compose.decide.Decided``) describes, opened through the
    one door on a world set up for it (closed again if opening fails)."""
    from vltrain.compose.builders import build_task
    from vltrain.compose.opening import open_model
    from vltrain.runtime.precision import Precision
    from vltrain.runtime.world import setup_world

    cfg = decided.cfg
    world = setup_world(timeout_s=cfg.train.timeout_s, device=cfg.train.device, threads=cfg.train.threads,
                        tf32=cfg.train.tf32)
    try:
        opened = open_model(decided, device=world.device)
        encoder = Encoder(build_task(cfg, opened.model), cfg.data, world.device,
                          Precision(cfg.train.precision, world.device).autocast)
    except BaseException:
        world.close(False)
        raise
    return Generating(encoder, opened.tokenizer, opened.model, world)

