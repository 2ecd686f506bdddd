"""The shared types: image tokens and their mask travel together, and the square form stays maskless."""

from __future__ import annotations

import torch

from vltrain.images import real_patches
from vltrain.types import Tokens


def test_square_tokens_are_all_real_and_attend_without_a_mask():
    square = Tokens(torch.randn(3, 5, 4))
    assert square.cross_mask is None
    assert square.mask.dtype == torch.bool and square.mask.all() and square.mask.shape == (3, 5)
    both = Tokens.cat([square, square.index_select(torch.tensor([2, 0]))])
    assert both.real is None and both.values.shape == (5, 5, 4)


def test_a_mask_goes_wherever_its_rows_go():
    grids = torch.tensor([[1, 2], [2, 2], [1, 1]])
    real = real_patches(grids, 4)
    assert real.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]
    tokens = Tokens(torch.randn(3, 4, 2), real)
    keep = torch.tensor([True, False, True])
    assert torch.equal(tokens[keep].mask, real[keep])  # boolean rows (evaluation's readable images)
    assert torch.equal(tokens[1:].mask, real[1:])
    assert torch.equal(tokens.index_select(torch.tensor([2, 2])).mask, real[[2, 2]])
    mixed = Tokens.cat([tokens, Tokens(torch.randn(1, 4, 2))])  # a square part counts as all real
    assert mixed.mask.dtype == torch.bool and mixed.mask[3].all() and torch.equal(mixed.mask[:3], real)
