"""``vltrain export RUN --adapters --out FOLDER``: a LoRA run's adapters as peft's own folder.

``peft.PeftModel.from_pretrained(transformers.CLIPModel.from_pretrained(BASE), FOLDER)`` puts them on
the Hugging Face model the run started from (``model.init``), and gives the run's embeddings;
``train.lora.adapters=FOLDER`` reads them back into a run. peft writes the folder itself: the
transformers model the run's base is (CLIPModel, SiglipModel or Siglip2Model, as ``--format hf``
would export it) is built without weights, wrapped by peft with the run's rank, scale and the layers
it adapted, given the run's adapter matrices
(:func:`vltrain.model.interop.peft_adapters.adapter_tensors`) and saved.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import vltrain.model.interop.hf_clip as hf_clip
from vltrain.compose.opening import open_model
from vltrain.errors import UserError
from vltrain.export.hf import hf_config, hf_family
from vltrain.model.interop.peft_adapters import PREFIX, adapter_tensors

log = logging.getLogger("vltrain")


def export_adapters(source: str | Path, out: str | Path, ema: bool = False) -> Path:
    """Write ``out``/{adapter_config.json, adapter_model.safetensors} from the LoRA run (or checkpoint)
    ``source``; ``ema``: the EMA of its adapters (``train.ema``)."""
    opened = open_model(source, ema=ema, purpose="export", merge=False)
    model, tokenizer, cfg, found = opened.model, opened.tokenizer, opened.cfg, opened.located
    name = str(found.weights) if found is not None else str(source)
    lora = cfg.train.lora
    if not lora.enabled:
        raise UserError(f"{name} has no LoRA adapters (train.lora.rank is 0): --adapters writes a LoRA run's; "
                        "export the whole model without it")
    try:
        family = hf_family(model, tokenizer, name, cfg)
    except UserError as e:
        raise UserError(f"--adapters writes peft adapters for the transformers model of the run, as --format hf "
                        f"would export it, and {e}") from None
    if family == "blip":
        raise UserError(f"{name}: --adapters writes peft adapters for a transformers CLIPModel, SiglipModel or "
                        "Siglip2Model, and this is a BLIP model; export it merged (--format hf) instead")
    wrapped = _peft_model(model, tokenizer, family, lora, adapter_tensors(model))
    wrapped.peft_config["default"].base_model_name_or_path = cfg.model.init or None
    out = Path(out)
    wrapped.save_pretrained(out, save_embedding_layers=False)
    if not cfg.model.init:
        log.info("export: the run started from fresh weights (no model.init): peft's base_model_name_or_path is "
                 "left empty")
    return out


def _peft_model(model, tokenizer, family: str, lora, tensors: dict[str, torch.Tensor]):
    """transformers' model of ``family`` for the run's architecture, wrapped by peft with LoRA on the
    layers ``tensors`` (peft's keys) adapt, the adapters copied in. Built on the meta device and then
    given memory without filling it: only the adapters are saved."""
    try:
        import peft
        import transformers
    except ImportError:
        raise UserError("--adapters writes peft's folder with peft and transformers: pip install "
                        "'vltrain[lora,hf]'") from None
    config = dict(hf_config(model, tokenizer, family))
    config.pop("architectures")
    hf_cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        hf = getattr(transformers, hf_clip.FAMILIES[family])(hf_cfg)
    targets = sorted({key.removeprefix(PREFIX).rpartition(".lora_")[0] for key in tensors})
    settings = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha or lora.rank, lora_dropout=lora.dropout,
                               target_modules=targets, bias="none")
    wrapped = peft.get_peft_model(hf, settings).to_empty(device="cpu")
    loaded = peft.set_peft_model_state_dict(wrapped, tensors)
    if loaded.unexpected_keys:
        raise UserError(f"peft found no place for {loaded.unexpected_keys[0]} in transformers' "
                        f"{hf_clip.FAMILIES[family]}")
    return wrapped
