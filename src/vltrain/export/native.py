"""Export a trained model to a self-contained folder, and embed images and texts with it.

``vltrain export RUN_DIR --out DIR`` writes::

    DIR/model.safetensors   full weights by plain FQN (consolidated from any sharding)
    DIR/tokenizer.json      the tokenizer the model was trained with
    DIR/config.yaml         the run's resolved config, pointing at the tokenizer next to it

safetensors holds tensors only, so loading an exported model runs no code from the file. The
folder is what :func:`load_exported` reads, for ``vltrain embed`` and ``vltrain eval``.
``--format hf`` writes a Hugging Face CLIPModel / SiglipModel / Siglip2Model folder instead
(:mod:`vltrain.export.hf`).
``--interpolate ALPHA`` writes (1 - ALPHA) x the run's initial weights + ALPHA x the trained ones
(WiSE-FT's weight-space ensemble; ALPHA 0 is the initial model, 1 the fine-tuned one).
Embeddings use the training pipeline itself (``decode_image``, the tokenizer, the collator,
``Batch.pixels``), so an image is seen exactly as it was in training. :func:`load_any` opens
whatever a user may name: an exported folder, a run or checkpoint folder, a Hugging Face folder or
an OpenCLIP checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from vltrain.checkpoint.manager import CONFIG_FILE, INITIAL_FILE, check_shapes, find_checkpoint, load_model_weights
from vltrain.checkpoint.storage import write_weights
from vltrain.config.job import JobConfig, load_config
from vltrain.data.tokenizers import load_tokenizer
from vltrain.errors import UserError
from vltrain.export.hf import hf_family, write_hf
from vltrain.model.interop.pretrained import is_pretrained
from vltrain.train.build import build_model_for, build_tokenizer, resolve_init

log = logging.getLogger("vltrain")
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


def _build(cfg: JobConfig, tokenizer_path: Path | str):
    """The model to load saved weights into (not model.init's: they would be overwritten)."""
    tokenizer = load_tokenizer(str(tokenizer_path), cfg.data.text_clean)
    return build_model_for(cfg, tokenizer, load_init=False), tokenizer


def _checkpoint_of(source: Path) -> Path:
    """The newest checkpoint of a run folder (honouring its checkpoint.folder), or a checkpoint itself."""
    folder = "checkpoints"
    run_config = source / CONFIG_FILE
    if run_config.is_file() and not (source / "state.json").is_file():
        folder = load_config(run_config).checkpoint.folder
    return find_checkpoint(source, folder)


def export_model(source: str | Path, out: str | Path, interpolate: float | None = None, fmt: str = "native") -> Path:
    """Write ``out``/{model.safetensors, tokenizer.json, config.yaml} from a run or checkpoint folder;
    ``interpolate``: blend the trained weights with the run's initial ones (:func:`interpolate_weights`);
    ``fmt`` "hf": a Hugging Face CLIPModel / SiglipModel / Siglip2Model folder instead (:mod:`vltrain.export.hf`)."""
    source = Path(source)
    if interpolate is not None and not 0.0 <= interpolate <= 1.0:
        raise UserError(f"--interpolate must be in [0, 1] (0: the initial weights, 1: the fine-tuned ones), "
                        f"got {interpolate}")
    ckpt = _checkpoint_of(source)
    if not (ckpt / CONFIG_FILE).is_file():
        raise UserError(f"checkpoint {ckpt} has no {CONFIG_FILE}; it cannot be exported")
    cfg = load_config(ckpt / CONFIG_FILE)
    tokenizer_path = ckpt / TOKENIZER_FILE if (ckpt / TOKENIZER_FILE).is_file() else Path(cfg.data.tokenizer)
    model, tokenizer = _build(cfg, tokenizer_path)
    family = hf_family(model, tokenizer, str(ckpt), cfg) if fmt == "hf" else ""  # refused before any loading
    load_model_weights(ckpt, model)
    metadata = {"format": "pt", "checkpoint": ckpt.name}
    if interpolate is not None:
        interpolate_weights(model, _initial_weights_of(source, ckpt), interpolate)
        metadata["interpolate"] = repr(interpolate)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family:
        for note in write_hf(model, tokenizer, cfg, out, family, metadata):
            log.info("export: %s", note)
        return out
    write_weights(out / WEIGHTS_FILE, model.state_dict(), metadata)
    tokenizer.save(out / TOKENIZER_FILE)
    cfg.data.tokenizer = TOKENIZER_FILE
    cfg.save(out / CONFIG_FILE)
    return out


def _initial_weights_of(source: Path, ckpt: Path) -> Path:
    """The run's init.safetensors: in the folder given, or in the run folder of its checkpoint."""
    for run_dir in (source, ckpt.parent.parent):
        if (run_dir / INITIAL_FILE).is_file():
            return run_dir / INITIAL_FILE
    raise UserError(f"--interpolate blends a run's initial weights ({INITIAL_FILE} in the run folder) with the "
                    f"trained ones, and {source} has none: a run writes them when model.init is set or with "
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


def is_exported(path: str | Path) -> bool:
    p = Path(path)
    return (p / WEIGHTS_FILE).is_file() and (p / CONFIG_FILE).is_file() and (p / TOKENIZER_FILE).is_file()


def load_exported(path: str | Path, device: str | torch.device = "cpu"):
    """``(model, tokenizer, cfg)`` from an exported folder; the model in eval mode on ``device``.

    ``cfg.data.tokenizer`` is set to the folder's tokenizer, so code that builds data from the
    config (evaluation) uses the right one wherever it runs.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path)
    if not is_exported(p):
        raise UserError(f"{p} is not an exported model folder (it needs {WEIGHTS_FILE}, {TOKENIZER_FILE} "
                        f"and {CONFIG_FILE}; write one with `vltrain export RUN_DIR --out {p}`)")
    cfg = load_config(p / CONFIG_FILE)
    cfg.data.tokenizer = str(p / TOKENIZER_FILE)
    model, tokenizer = _build(cfg, cfg.data.tokenizer)
    with safe_open(str(p / WEIGHTS_FILE), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    check_shapes(str(p / WEIGHTS_FILE), saved, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.load_state_dict(load_file(str(p / WEIGHTS_FILE)))
    return model.to(device).eval(), tokenizer, cfg


def load_any(path: str | Path, overrides: list[str] | None = None, device: str | torch.device = "cpu"):
    """``(model, tokenizer, cfg)`` from an exported folder, a run or checkpoint folder, a Hugging Face
    CLIPModel / SiglipModel / Siglip2Model folder or an OpenCLIP checkpoint (``overrides``: dotted config values,
    e.g. data.tokenizer for an OpenCLIP file without one beside it); the model in eval mode."""
    p = Path(path).expanduser()
    overrides = list(overrides or [])
    if is_exported(p):
        if overrides:
            raise UserError(f"{p} is an exported model: its config is fixed ({', '.join(overrides)} cannot apply)")
        return load_exported(p, device)
    if is_pretrained(p):
        cfg = load_config(None, [f"model.init={p}", *overrides])
        resolve_init(cfg)
        tokenizer = build_tokenizer(cfg)
        return build_model_for(cfg, tokenizer, device).eval(), tokenizer, cfg
    ckpt = _checkpoint_of(p)
    cfg = load_config(ckpt / CONFIG_FILE, overrides)
    tokenizer_path = ckpt / TOKENIZER_FILE if (ckpt / TOKENIZER_FILE).is_file() else Path(cfg.data.tokenizer)
    model, tokenizer = _build(cfg, tokenizer_path)
    load_model_weights(ckpt, model)
    return model.to(device).eval(), tokenizer, cfg


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
