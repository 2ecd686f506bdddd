"""Config of the model: a preset name plus the overrides a user may want of it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextConfig:
    hf_path: str = ""
    """A local Hugging Face encoder folder (needs the `hf` extra); its tokenizer.json is used."""
    pooling: str = ""
    """first | eos | mean; empty: the preset's choice."""


@dataclass
class LossConfig:
    itc: float = 1.0
    siglip: float = 0.0
    itm: float = 1.0
    mlm: float = 0.0


@dataclass
class ModelConfig:
    preset: str = "tiny-clip"
    text: TextConfig = field(default_factory=TextConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    embed_dim: int = 0
    """0: the preset's."""
