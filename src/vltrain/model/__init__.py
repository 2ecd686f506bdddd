"""Vision-language models: towers, fusion, heads, presets and the composed ``VLModel``."""

from vltrain.model.builder import build_model, count_parameters
from vltrain.model.model import VLModel
from vltrain.model.presets import PRESETS, Architecture, list_presets
from vltrain.model.text import hf_tokenizer_file

__all__ = [
    "Architecture",
    "PRESETS",
    "VLModel",
    "build_model",
    "count_parameters",
    "hf_tokenizer_file",
    "list_presets",
]
