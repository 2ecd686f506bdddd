"""The text tower over a batch's text tokens alone, packed: the same result as over the padded batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kits.modelkit import forward_calls

from vltrain.config.job import load_config
from vltrain.errors import ConfigError
from vltrain.model.text import MIN_SAVING, TextTowerConfig, TextTransformer, packed_tokens


def _batch(lengths: list[int], vocab: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(max(lengths), 1)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1, vocab, (len(lengths), width), generator=g) * mask, mask


LENGTHS = [27, 22, 16, 18, 21, 12, 10, 11, 30, 16, 9, 24, 0, 32, 11, 9]  # one row without text


def test_packing_keeps_every_text_token_and_each_rows_first_position():
    _, mask = _batch(LENGTHS)
    packed = packed_tokens(mask, "auto")
    keep = mask.bool().clone()
    keep[:, 0] = True
    assert packed.index.tolist() == keep.reshape(-1).nonzero().squeeze(1).tolist()
    assert len(packed.index) == sum(LENGTHS) + 1 <= (1 - MIN_SAVING) * mask.numel()
    x = torch.arange(len(packed.index), dtype=torch.float32)[:, None].expand(-1, 3)
    padded = packed.unpack(x)
    assert padded.shape == (len(LENGTHS), 32, 3)
    assert torch.equal(padded.reshape(-1, 3)[packed.index], x) and padded[~keep].abs().sum() == 0


@pytest.mark.parametrize("multiple", [16, 64, 1000])
def test_a_pack_multiple_rounds_the_token_count_up_with_padding_positions(multiple):
    _, mask = _batch(LENGTHS)
    plain, rounded = packed_tokens(mask, "packed"), packed_tokens(mask, "packed", multiple)
    real = len(plain.index)
    assert rounded.real == real and torch.equal(rounded.index[:real], plain.index)
    assert len(rounded.index) == min(-(-real // multiple) * multiple, mask.numel())  # 1000: every position
    extra = rounded.index[real:]
    keep = mask.bool().clone()
    keep[:, 0] = True
    assert not keep.reshape(-1)[extra].any() and len(set(rounded.index.tolist())) == len(rounded.index)


@pytest.mark.parametrize("lengths,layout", [
    ([20, 19, 20, 18, 20, 20, 17, 20], "auto"),  # similar lengths (budget batching): too little to skip
    (LENGTHS, "padded"),
])
def test_no_packing_when_it_would_not_pay_or_is_off(lengths, layout):
    _, mask = _batch(lengths)
    assert packed_tokens(mask, layout) is None


def test_packed_packs_whatever_it_saves():
    _, mask = _batch([20, 19, 20, 18, 20, 20, 17, 20])
    assert len(packed_tokens(mask, "packed").index) == 154


@pytest.mark.parametrize("pooling,causal,bert,multiple", [
    ("eos", True, False, 1), ("mean", False, False, 1), ("first", False, False, 1), ("first", False, True, 1),
    ("eos", True, True, 1), ("eos", True, False, 64), ("mean", False, True, 64),
])
def test_packed_tower_computes_what_the_padded_one_does(pooling, causal, bert, multiple):
    """``bert``: BLIP's text tower (an embedding norm, post-norm layers, no final norm); ``multiple``:
    the token count rounded up with padding positions, whose results must not reach any row."""
    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=2, heads=4, pooling=pooling, causal=causal,
                          layout="packed", embed_norm=bert, post_norm=bert, pack_multiple=multiple)
    packed = TextTransformer(cfg).double()
    padded = TextTransformer(replace(cfg, layout="padded")).double()
    padded.load_state_dict(packed.state_dict())
    ids, mask = _batch(LENGTHS)
    (t1, p1), (t0, p0) = packed(ids, mask), padded(ids, mask)
    assert t1.shape == t0.shape and p1.shape == p0.shape
    text = mask.bool()
    keep = text.clone()
    keep[:, 0] = True
    assert t1[~keep].abs().sum() == 0  # padding positions come back zero, rounded or not
    torch.testing.assert_close(t1[text], t0[text], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(p1, p0, rtol=1e-10, atol=1e-12)
    g1 = torch.autograd.grad(p1.square().sum() + t1[text].sum(), list(packed.parameters()))
    g0 = torch.autograd.grad(p0.square().sum() + t0[text].sum(), list(padded.parameters()))
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_packed_tower_under_activation_checkpointing():
    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=2, heads=4, pooling="eos", causal=True,
                          layout="packed")
    tower = TextTransformer(cfg).double()
    ids, mask = _batch(LENGTHS)
    with forward_calls(*tower.blocks) as once:
        plain = torch.autograd.grad(tower(ids, mask)[1].square().sum(), list(tower.parameters()))
    tower.checkpointing = True
    with forward_calls(*tower.blocks) as twice:  # each block recomputed in the backward
        again = torch.autograd.grad(tower(ids, mask)[1].square().sum(), list(tower.parameters()))
    assert once == [1, 1] and twice == [2, 2]
    for a, b in zip(plain, again):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_last_pooling_reads_the_batch_width_and_is_never_packed():
    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=1, heads=4, pooling="last", layout="packed")
    tower = TextTransformer(cfg).double()
    padded = TextTransformer(replace(cfg, layout="padded")).double()
    padded.load_state_dict(tower.state_dict())
    ids, mask = _batch(LENGTHS)
    assert torch.equal(tower(ids, mask)[0], padded(ids, mask)[0])


def test_auto_packs_on_cpu_and_the_setting_is_checked():
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=1, heads=4, pooling="eos")
    assert cfg.layout == "auto"
    seen = []
    tower = TextTransformer(cfg)
    tower.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    ids, mask = _batch(LENGTHS)
    tower(ids, mask)
    assert seen == [torch.Size([sum(LENGTHS) + 1, 32])]
    assert load_config(None, ["model.text.layout=padded"]).model.text.layout == "padded"
    with pytest.raises(ConfigError, match="model.text.layout"):
        load_config(None, ["model.text.layout=sometimes"])
    assert load_config(None, ["model.text.pack_multiple=64"]).model.text.pack_multiple == 64
    with pytest.raises(ConfigError, match="model.text.pack_multiple"):
        load_config(None, ["model.text.pack_multiple=0"])


def test_a_pack_multiple_gives_the_blocks_rounded_row_counts():
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=1, heads=4, pooling="eos", pack_multiple=64)
    seen = []
    tower = TextTransformer(cfg)
    tower.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    for lengths in (LENGTHS, [n // 2 + 1 for n in LENGTHS]):
        tower(*_batch(lengths))
    assert seen == [torch.Size([320, 32]), torch.Size([192, 32])]  # 269 and 148 tokens


def test_a_bert_tower_norms_its_embeddings_and_ends_in_its_last_layers_norm():
    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=2, heads=4, pooling="first", embed_norm=True,
                          post_norm=True, norm_eps=1e-12, layout="padded")
    tower = TextTransformer(cfg)
    assert tower.norm is None and tower.embed_norm.eps == 1e-12
    ids, mask = _batch([5, 3])
    seen = {}
    tower.blocks[0].register_forward_pre_hook(lambda module, args: seen.setdefault("in", args[0]))
    tower.blocks[1].register_forward_hook(lambda module, args, out: seen.setdefault("out", out))
    tokens, pooled = tower(ids, mask)
    embedded = tower.token_embedding(ids) + tower.pos_embed[:5]
    ln = torch.nn.functional.layer_norm(embedded, (32,), tower.embed_norm.weight, tower.embed_norm.bias, 1e-12)
    torch.testing.assert_close(seen["in"], ln, atol=0, rtol=0)
    assert torch.equal(tokens, seen["out"]) and torch.equal(pooled, tokens[:, 0])


def test_the_start_id_replaces_the_first_token_in_training_and_generation():
    """BLIP's decoder reads its [DEC] token where the tokenizer put [CLS]: the tower reads it in
    place of whatever position 0 holds, and generation from it reads what training read."""
    from vltrain.model.blocks import LayerCache

    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=2, heads=4, pooling="eos", causal=True,
                          embed_norm=True, post_norm=True, start_id=49, layout="padded")
    tower = TextTransformer(cfg).eval()
    plain = TextTransformer(replace(cfg, start_id=None)).eval()
    plain.load_state_dict(tower.state_dict())
    ids, mask = _batch([6, 6])
    ids[:, 0] = 2
    started = ids.clone()
    started[:, 0] = 49
    with torch.no_grad():
        tokens, _ = tower(ids, mask)
        assert torch.equal(tokens, plain(started, mask)[0])
        assert not torch.allclose(tokens, plain(ids, mask)[0], atol=1e-3)
        caches = [LayerCache() for _ in tower.blocks]
        stepped = [tower.step(ids[:, :2], caches, 0)]
        stepped += [tower.step(ids[:, t: t + 1], caches, t) for t in range(2, 6)]
        torch.testing.assert_close(torch.cat(stepped, dim=1), tokens, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_tower_that_fuses_encodes_text_alone_as_one_without_cross_attention(layout):
    """BLIP's text encoder under a shared fusion: text alone skips the cross-attention (the same pooled
    vector as the tower without it), the tokens handed on are the embedded ones, and the fusion pass
    over them reads the image, each row its own."""
    from vltrain.model.blocks import key_padding_mask

    torch.manual_seed(0)
    cfg = TextTowerConfig(vocab_size=50, max_length=32, width=32, depth=2, heads=4, pooling="first", embed_norm=True,
                          post_norm=True, norm_eps=1e-12, layout=layout)
    fusing = TextTransformer(cfg, image_width=24).double()
    plain = TextTransformer(cfg).double()
    plain.load_state_dict(fusing.state_dict(), strict=False)
    ids, mask = _batch(LENGTHS[:6])
    (embedded, pooled), (_, alone) = fusing(ids, mask), plain(ids, mask)
    torch.testing.assert_close(pooled, alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(embedded, fusing._embed(ids), rtol=0, atol=0)
    image = torch.randn(6, 5, 24, dtype=torch.float64)
    fused = fusing.fuse(embedded, key_padding_mask(mask), image, None)
    assert not torch.allclose(fused[:, 0], pooled, atol=1e-3)
    one = fusing.fuse(embedded[2:3], key_padding_mask(mask[2:3]), image[2:3], None)
    torch.testing.assert_close(one, fused[2:3], rtol=0, atol=1e-12)
