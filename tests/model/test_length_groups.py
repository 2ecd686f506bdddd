"""The text tower encodes a batch in groups of similar caption length: the same result as padded."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vltrain.config import load_config
from vltrain.errors import ConfigError
from vltrain.model.text import MIN_SAVING, TextTowerConfig, TextTransformer, length_groups


def _batch(lengths: list[int], vocab: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(max(lengths), 1)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1, vocab, (len(lengths), width), generator=g) * mask, mask


LENGTHS = [27, 22, 16, 18, 21, 12, 10, 11, 30, 16, 9, 24, 0, 32, 11, 9]  # one row without text


def test_groups_cover_every_row_once_at_their_longest_length():
    _, mask = _batch(LENGTHS)
    rows, widths = length_groups(mask, 4)
    assert sorted(torch.cat(rows).tolist()) == list(range(len(LENGTHS)))
    assert widths == [max(1, max(LENGTHS[i] for i in r.tolist())) for r in rows]
    assert widths == sorted(widths) and len(rows) == 4
    used = sum(w * len(r) for r, w in zip(rows, widths))
    assert used <= (1 - MIN_SAVING) * mask.numel()


@pytest.mark.parametrize("lengths,groups", [
    ([20, 19, 20, 18, 20, 20, 17, 20], 4),  # similar lengths (budget batching): nothing to skip
    (LENGTHS, 1),  # grouping off
])
def test_no_grouping_when_it_would_not_pay_or_is_off(lengths, groups):
    _, mask = _batch(lengths)
    assert length_groups(mask, groups) is None


def test_no_more_groups_than_rows():
    _, mask = _batch([5, 30])
    rows, widths = length_groups(mask, 4)
    assert [r.tolist() for r in rows] == [[0], [1]] and widths == [5, 30]


@pytest.mark.parametrize("pooling,causal", [("eos", True), ("mean", False), ("first", False)])
def test_grouped_tower_computes_what_the_padded_one_does(pooling, causal):
    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=2, heads=4, pooling=pooling, causal=causal,
                          length_groups=4)
    grouped = TextTransformer(cfg).double()
    padded = TextTransformer(replace(cfg, length_groups=1)).double()
    padded.load_state_dict(grouped.state_dict())
    ids, mask = _batch(LENGTHS)
    assert length_groups(mask, 4) is not None
    (t1, p1), (t0, p0) = grouped(ids, mask), padded(ids, mask)
    assert t1.shape == t0.shape and p1.shape == p0.shape
    text = mask.bool()
    torch.testing.assert_close(t1[text], t0[text], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(p1, p0, rtol=1e-10, atol=1e-12)
    g1 = torch.autograd.grad(p1.square().sum() + t1[text].sum(), list(grouped.parameters()))
    g0 = torch.autograd.grad(p0.square().sum() + t0[text].sum(), list(padded.parameters()))
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_last_pooling_reads_the_batch_width_and_is_never_grouped():
    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=1, heads=4, pooling="last", length_groups=4)
    tower = TextTransformer(cfg).double()
    ids, mask = _batch(LENGTHS)
    _, pooled = tower(ids, mask)
    padded = TextTransformer(replace(cfg, length_groups=1)).double()
    padded.load_state_dict(tower.state_dict())
    torch.testing.assert_close(pooled, padded(ids, mask)[1], rtol=0, atol=0)


def test_auto_groups_on_cpu_and_the_setting_is_checked():
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=1, heads=4, pooling="eos")
    assert cfg.length_groups == 0  # auto
    calls = []
    tower = TextTransformer(cfg)
    tower.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(args[0]))
    ids, mask = _batch(LENGTHS)
    tower(ids, mask)
    assert isinstance(calls[0], list) and len(calls[0]) == 4  # one call of the block, four groups
    assert load_config(None, ["model.text.length_groups=1"]).model.text.length_groups == 1
    with pytest.raises(ConfigError, match="model.text.length_groups"):
        load_config(None, ["model.text.length_groups=-1"])
