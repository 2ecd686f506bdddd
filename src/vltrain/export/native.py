"""Export a trained model to a self-contained folder, and embed images and texts with it.

``vltrain export RUN_DIR --out DIR`` writes::

    DIR/model.safetensors   full weights by plain FQN (consolidated from any sharding)
    DIR/tokenizer.json      the tokenizer the model was trained with
    DIR/config.yaml         the run's resolved config, pointing at the tokenizer next to it

safetensors holds tensors only, so loading an exported model runs no code from the file. The
folder opens like any other model (:func:`vltrain.compose.opening.open_model`), for ``vltrain
embed``, ``vltrain eval`` and ``model.init``.
``--format hf`` writes a Hugging Face CLIPModel / SiglipModel / Siglip2Model folder instead
(:mod:`vltrain.export.hf`), or a BlipForConditionalGeneration one for a BLIP captioner
(:mod:`vltrain.export.hf_blip`); ``--format openclip`` the folder OpenCLIP opens, for CoCa models of
its structure (:mod:`vltrain.export.openclip`).
``--interpolate ALPHA`` writes (1 - ALPHA) x the run's initial weights + ALPHA x the trained ones
(WiSE-FT's weight-space ensemble; ALPHA 0 is the initial model, 1 the fine-tuned one).
A LoRA run (``train.lora``) is exported in every format with its adapters merged into the weights,
its config.yaml saying no LoRA; ``--adapters`` writes the adapters alone, as peft's folder
(:mod:`vltrain.export.adapters`).
Embeddings use the training pipeline itself (``decode_image``, the tokenizer, the collator,
``Batch.pixels``), so an image is seen exactly as it was in training.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from vltrain.checkpoint.manager import INITIAL_FILE, check_shapes
from vltrain.checkpoint.paths import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, Located
from vltrain.checkpoint.storage import write_weights
from vltrain.compose.opening import open_model
from vltrain.config.job import JobConfig
from vltrain.errors import UserError
from vltrain.export.hf import hf_family, write_hf
from vltrain.export.hf_blip import check_blip, write_blip
from vltrain.export.openclip import check_openclip, write_openclip
from vltrain.model.lora import LoraSettings
from vltrain.types import revise

log = logging.getLogger("vltrain")


def export_model(source: str | Path, out: str | Path, interpolate: float | None = None, fmt: str = "native",
                 ema: bool = False) -> Path:
    """Write ``out``/{model.safetensors, tokenizer.json, config.yaml} from any model vltrain opens (a run,
    a checkpoint, an export, an imported checkpoint); ``interpolate``: blend a run's trained weights with
    its initial ones (:func:`interpolate_weights`); ``fmt`` "hf": a Hugging Face CLIPModel / SiglipModel /
    Siglip2Model / BlipForConditionalGeneration folder instead (:mod:`vltrain.export.hf`); ``ema``: a run's EMA weights (``train.ema``)
    instead of its trained ones (interpolated with the initial ones when both are asked)."""
    if interpolate is not None and not 0.0 <= interpolate <= 1.0:
        raise UserError(f"--interpolate must be in [0, 1] (0: the initial weights, 1: the fine-tuned ones), "
                        f"got {interpolate}")
    opened = open_model(source, ema=ema, purpose="export")
    model, tokenizer, cfg, found = opened.model, opened.tokenizer, opened.cfg, opened.located
    family = hf_family(model, tokenizer, str(found.weights), cfg) if fmt == "hf" else ""
    blip = check_blip(model, tokenizer, cfg, str(found.weights)) if family == "blip" else None
    coca = check_openclip(model, cfg, str(found.weights)) if fmt == "openclip" else None
    metadata = {"format": "pt", "checkpoint": found.weights.name, **({"ema": "true"} if ema else {})}
    if interpolate is not None:
        interpolate_weights(model, _initial_weights_of(found), interpolate)
        metadata["interpolate"] = repr(interpolate)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family or coca is not None:
        if blip is not None:
            notes = write_blip(model, tokenizer, cfg, out, blip, metadata)
        else:
            notes = (write_hf(model, tokenizer, cfg, out, family, metadata) if family
                     else write_openclip(model, tokenizer, cfg, out, coca, metadata))
        for note in notes:
            log.info("export: %s", note)
        return out
    write_weights(out / WEIGHTS_FILE, model.state_dict(), metadata)
    tokenizer.save(out / TOKENIZER_FILE)
    # the copy beside it: a LoRA run's adapters are merged into the weights, so the export has none
    revise(cfg, data=revise(cfg.data, tokenizer=TOKENIZER_FILE),
           train=revise(cfg.train, lora=LoraSettings())).save(out / CONFIG_FILE)
    return out


def _initial_weights_of(found: Located) -> Path:
    """The run's init.safetensors: in the folder given, or in the run folder of its checkpoint."""
    ckpt = found.checkpoint
    for run_dir in (found.path,) + (() if ckpt is None else (ckpt.parent.parent,)):
        if (run_dir / INITIAL_FILE).is_file():
            return run_dir / INITIAL_FILE
    raise UserError(f"--interpolate blends a run's initial weights ({INITIAL_FILE} in the run folder) with the "
                    f"trained ones, and {found.path} has none: a run writes them when model.init is set or with "
                    "checkpoint.save_initial=always")


@torch.no_grad()
def interpolate_weights(model: torch.nn.Module, initial_path: Path, alpha: float) -> None:
    """In place: each floating-point tensor <- (1 - alpha) x initial + alpha x its value.

    ``torch.lerp`` is exact at both ends (alpha 0 gives the initial tensor, 1 the trained one), and a
    tensor that did not change (a frozen tower) stays bit for bit what it was.
    """
    from safetensors.torch import load_file

    initial = load_file(str(initial_path))
    state = model.state_dict()
    check_shapes(f"initial weights {initial_path}", {k: tuple(v.shape) for k, v in initial.items()},
                 {k: tuple(v.shape) for k, v in state.items()})
    done: set[int] = set()  # tied weights are one tensor under two names: blend it once
    for key, value in state.items():
        if value.is_floating_point() and value.data_ptr() not in done:
            done.add(value.data_ptr())
            value.copy_(torch.lerp(initial[key].to(value.device, value.dtype), value, alpha))


@torch.no_grad()
def embed(model, tokenizer, cfg: JobConfig, images: list[str | Path], texts: list[str],
          batch_size: int = 64, device: str | torch.device = "cpu") -> np.ndarray:
    """Normalized embeddings [len(images) + len(texts), D], images first, float32."""
    from vltrain.data.dataset import Sample
    from vltrain.data.image_input import decode_for
    from vltrain.data.images import ImageError
    from vltrain.data.loading.collate import Collator

    dc = cfg.data
    samples = []
    for i, path in enumerate(images):
        try:
            pixels, grid = decode_for(Path(path).read_bytes(), dc)
        except (OSError, ImageError) as e:
            raise UserError(f"cannot read image {path}: {e}") from None
        samples.append(Sample(uid=i, key=str(path), image=pixels, input_ids=[], truncated=False, source=0, grid=grid))
    for i, text in enumerate(texts):
        ids, truncated = tokenizer.encode(text, dc.max_text_length)
        samples.append(Sample(uid=len(images) + i, key=f"text {i}", image=None, input_ids=ids,
                              truncated=truncated, source=0))
    collate = Collator.for_data(tokenizer.pad_id, dc)
    rows = []
    for start in range(0, len(samples), batch_size):
        inputs = collate(samples[start:start + batch_size]).to_model_inputs(device, dc.mean, dc.std)
        enc = model.encode(inputs)
        rows.append(torch.where(inputs.has_image[:, None], enc.image_embeds, enc.text_embeds).float().cpu())
    if not rows:
        return np.zeros((0, 0), dtype=np.float32)
    return torch.cat(rows).numpy()
