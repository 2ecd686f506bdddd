"""vltrain: train vision-language models (CLIP-style dual encoders and ALBEF-style fusion models)."""

__version__ = "0.1.0"
