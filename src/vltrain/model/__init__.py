"""Vision-language models: towers, fusion, heads, presets and the composed ``VLModel``."""

from vltrain.model.model import Encoded, ITMPairs, ModelOutput, VLModel
from vltrain.model.presets import PRESETS, Architecture, build_model, count_parameters, list_presets
from vltrain.model.text import hf_tokenizer_file

__all__ = [
    "Architecture",
    "Encoded",
    "ITMPairs",
    "ModelOutput",
    "PRESETS",
    "VLModel",
    "build_model",
    "count_parameters",
    "hf_tokenizer_file",
    "list_presets",
]
