"""``vltrain export --format hf`` of a BLIP model: a folder ``transformers.BlipForConditionalGeneration``
(a captioner) or ``BlipForImageTextRetrieval`` loads, with BlipProcessor's files.

It holds config.json, model.safetensors (every tensor the transformers model has, none it lacks),
tokenizer.json with a tokenizer_config.json naming BERT's special tokens and [DEC], and
preprocessor_config.json (BlipImageProcessor: the run's image size, filter and statistics, images
squashed to a square as BLIP's processor does). Models of BLIP's structure are written so: those
read from a BLIP folder, fine-tuned or not (:func:`vltrain.model.interop.hf_blip.exportable` names
what else differs). What transformers' class has no place for (a captioner's projections, either
model's temperature) is left out, and said so.
"""

from __future__ import annotations

import json
from pathlib import Path

import vltrain.model.interop.hf_blip as blip
from vltrain.checkpoint.storage import write_weights
from vltrain.config.job import JobConfig
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.export.hf import HF_ACT, architecture_of
from vltrain.model import VLModel
from vltrain.model.interop.convert import convert_out
from vltrain.model.presets import Architecture
from vltrain.pixels import RESAMPLE

def check_blip(model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, name: str) -> Architecture:
    """The architecture of ``model`` when transformers' BLIP class (:func:`~vltrain.model.interop.hf_blip.class_of`)
    can hold it and BlipProcessor would prepare its inputs as the run did; else one line saying why."""
    refuse = f"{name} cannot be exported with --format hf"
    arch = architecture_of(model)
    missing = blip.exportable(arch)
    if arch.decoder is None and model.itm_head is None:
        missing = "; ".join(filter(None, [missing, "an ITM head (model.loss.itm > 0)"]))
    if missing:
        raise UserError(f"{refuse}: it has BLIP's text layers, and transformers' {blip.class_of(arch)} needs "
                        f"{missing}; use --format native")
    if cfg.data.resize != "squash":
        raise UserError(f"{refuse}: BLIP's image processor squashes each image to a square, and this run read them "
                        f"with data.resize {cfg.data.resize}; use --format native")
    start = arch.text.start_id
    if arch.decoder is not None and (tokenizer.eos_id is None or start >= model.text.token_embedding.num_embeddings):
        raise UserError(f"{refuse}: a BLIP captioner ends its captions at [SEP] and starts them at its start token "
                        f"{start}, and the tokenizer ({tokenizer.path}) or the vocabulary lacks one")
    return arch


def write_blip(model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, out: Path, arch: Architecture,
               metadata: dict[str, str]) -> list[str]:
    """Write the folder; returns notes for the user (parts left out)."""
    state = model.state_dict()
    links = [link for link in blip.links(arch) if link.ours in state]
    write_weights(out / "model.safetensors", blip.join(convert_out(links, state), arch), metadata)
    # the start token: the captioner's own, else the tokenizer's [DEC] (transformers' bos_token_id)
    start = arch.text.start_id if arch.text.start_id is not None else tokenizer.hf.token_to_id("[DEC]")
    ids = {"bos_token_id": start, "sep_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    config = blip.model_config(arch, model.text.token_embedding.num_embeddings, model.text.pos_embed.shape[0], ids,
                               HF_ACT)
    d, name = cfg.data, tokenizer.hf.id_to_token
    processor = {"image_processor_type": "BlipImageProcessor", "do_resize": True,
                 "size": {"height": d.image_size, "width": d.image_size}, "resample": RESAMPLE[d.interpolation],
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(d.mean),
                 "image_std": list(d.std), "do_convert_rgb": True}
    specials = {"pad_token": tokenizer.pad_id, "cls_token": tokenizer.cls_id, "sep_token": tokenizer.eos_id,
                "mask_token": tokenizer.mask_id, "bos_token": start}
    tokens = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": d.max_text_length,
              **{key: name(i) for key, i in specials.items() if i is not None and name(i) is not None}}
    for file, content in (("config.json", config), ("preprocessor_config.json", processor),
                          ("tokenizer_config.json", tokens)):
        (out / file).write_text(json.dumps(content, indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
    left = sorted({k.split(".", 1)[0] for k in state if k not in {link.ours for link in links}})
    return [f"left out (transformers' {blip.class_of(arch)} has no place for them): {', '.join(left)}"] if left else []
