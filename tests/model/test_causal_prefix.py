"""Causal text without an explicit mask (``is_causal``, what CUDA runs to keep the flash and cuDNN
kernels eligible) gives every real position what the explicit key-padding mask gives."""

from __future__ import annotations

import torch

from vltrain.model.blocks import CAUSAL_PREFIX, key_padding_mask, run_blocks, text_mask
from vltrain.model.text import TextTowerConfig, TextTransformer


def test_is_causal_matches_the_padding_mask_at_every_real_position():
    torch.manual_seed(0)
    tower = TextTransformer(TextTowerConfig(vocab_size=64, width=32, depth=2, heads=4, max_length=16, causal=True))
    lengths = torch.tensor([16, 9, 3, 1])
    attention_mask = (torch.arange(16)[None, :] < lengths[:, None]).long()  # right padding, as collated
    x = tower._embed(torch.randint(2, 64, (4, 16)))
    explicit = run_blocks(tower.blocks, x, key_padding_mask(attention_mask, causal=True))
    kernel = run_blocks(tower.blocks, x, CAUSAL_PREFIX)
    real = attention_mask.bool()
    torch.testing.assert_close(kernel[real], explicit[real], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(kernel[~real], explicit[~real])  # padded positions do differ: never read
    assert isinstance(text_mask(attention_mask, causal=True), torch.Tensor)  # the CPU keeps the mask
