"""A CLIP checkpoint read with more text positions than it has: Long-CLIP's stretched table, the
checkpoint's own embeddings on captions within the kept rows, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vltrain.compose.decide import decide, describe_preprocessing
from vltrain.config.job import load_config
from vltrain.errors import ConfigError
from vltrain.model.interop.stretch import stretch_positions


def longclip_table(pe: torch.Tensor, keep_len: int = 20) -> torch.Tensor:
    """Long-CLIP's loop (``load_from_clip`` in its model/longclip.py), written out as it reads."""
    length, dim = pe.shape
    new = torch.zeros([4 * length - 3 * keep_len, dim], dtype=pe.dtype)
    for i in range(keep_len):
        new[i] = pe[i]
    for i in range(length - 1 - keep_len):
        new[4 * i + keep_len] = pe[i + keep_len]
        new[4 * i + 1 + keep_len] = 3 * pe[i + keep_len] / 4 + 1 * pe[i + 1 + keep_len] / 4
        new[4 * i + 2 + keep_len] = 2 * pe[i + keep_len] / 4 + 2 * pe[i + 1 + keep_len] / 4
        new[4 * i + 3 + keep_len] = 1 * pe[i + keep_len] / 4 + 3 * pe[i + 1 + keep_len] / 4
    for j in range(4):
        new[4 * length - 3 * keep_len - 4 + j] = pe[length - 1] + j * (pe[length - 1] - pe[length - 2]) / 4
    return new


def test_77_to_248_is_long_clips_table_bit_for_bit():
    pe = torch.randn(77, 512, generator=torch.Generator().manual_seed(0))
    ours = stretch_positions(pe, 248, 20)
    assert ours.shape == (248, 512) and torch.equal(ours, longclip_table(pe))
    assert torch.equal(stretch_positions(pe.half(), 248, 20), longclip_table(pe.half().float()).half())


@pytest.mark.parametrize("old,new,keep", [(77, 100, 20), (77, 248, 0), (16, 40, 5), (16, 17, 15), (77, 1000, 20)])
def test_any_length_interpolates_the_old_rows_at_evenly_spread_positions(old, new, keep):
    """On a table that is linear in the position, row n of the stretched one is the old table at
    keep + (n - keep) x (old - keep) / (new - keep): evenly spread, the last ones along the last step."""
    slope = torch.randn(1, 8, dtype=torch.float64)
    table = torch.arange(old, dtype=torch.float64)[:, None] * slope + 3.0
    ours = stretch_positions(table, new, keep)
    n = torch.arange(new, dtype=torch.float64)
    where = torch.where(n < keep, n, keep + (n - keep) * (old - keep) / (new - keep))
    torch.testing.assert_close(ours, where[:, None] * slope + 3.0)
    assert torch.equal(ours[:keep], table[:keep])
    assert where[-1] < old  # never beyond one step past the last old row


def test_a_caption_within_the_kept_rows_embeds_as_the_checkpoint_does(tmp_path):
    """The stretched import against transformers' CLIPModel itself: a caption of at most
    stretch_keep tokens gives its embedding; a longer one reads the stretched rows."""
    pytest.importorskip("transformers")
    from kits.pretrainedkit import make_clip, normalized

    from vltrain.compose.opening import open_model
    from vltrain.export.native import embed

    hf = make_clip(tmp_path / "clip")  # 16 positions
    decided = decide(load_config(None, [f"model.init={tmp_path / 'clip'}", "data.max_text_length=40",
                                        "model.text.stretch_keep=6"]), purpose="embed")
    assert decided.cfg.model.arch["text"]["max_length"] == 40 and decided.cfg.data.max_text_length == 40
    assert "text positions stretched from 16 to 40" in describe_preprocessing(decided.cfg, decided.imported)
    opened = open_model(decided)
    model, tokenizer, cfg = opened.model, opened.tokenizer, opened.cfg
    table = hf.text_model.embeddings.position_embedding.weight.detach()
    assert torch.equal(model.text.pos_embed.detach(), stretch_positions(table, 40, 6))

    short = ["a red circle", "cat", "a photo of a"]  # at most 6 tokens with the start and end tokens
    assert max(len(tokenizer.encode(t, 40)[0]) for t in short) <= 6
    ids = [tokenizer.encode(t, 40)[0] for t in short]
    batch = torch.tensor([i + [tokenizer.pad_id] * (6 - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (6 - len(i)) for i in ids])
    with torch.no_grad():
        want = normalized(hf.get_text_features(input_ids=batch, attention_mask=mask))
    np.testing.assert_allclose(embed(model, tokenizer, cfg, [], short), want, atol=1e-6)

    plain = open_model(tmp_path / "clip", purpose="embed")
    long = " ".join(["large blue square of a green triangle"] * 5)  # 37 tokens
    assert not np.allclose(embed(model, tokenizer, cfg, [], [long]),
                           embed(plain.model, plain.tokenizer, plain.cfg, [], [long]), atol=1e-3)


def test_a_length_within_the_context_stretches_nothing(tmp_path):
    pytest.importorskip("transformers")
    from kits.pretrainedkit import make_clip

    make_clip(tmp_path / "clip")
    decided = decide(load_config(None, [f"model.init={tmp_path / 'clip'}", "data.max_text_length=12"]))
    assert decided.imported.stretch is None and decided.cfg.model.arch["text"]["max_length"] == 16


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        decide(load_config(None, overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_stretches_are_one_line_errors(tmp_path):
    pytest.importorskip("transformers")
    from kits.pretrainedkit import make_clip, make_siglip

    make_clip(tmp_path / "clip")
    make_siglip(tmp_path / "siglip")
    clip = f"model.init={tmp_path / 'clip'}"
    message = _refusal([clip, "data.max_text_length=40"])  # the default keeps 20 of 16
    assert "model.text.stretch_keep 20" in message and "fewer than" in message and "16" in message
    assert "stretch_keep" in _refusal([clip, "data.max_text_length=40", "model.text.stretch_keep=16"])
    with pytest.raises(ConfigError, match="model.text.stretch_keep must be 0 or more"):
        load_config(None, [clip, "model.text.stretch_keep=-1"])
    message = _refusal([f"model.init={tmp_path / 'siglip'}", "data.max_text_length=40"])
    assert "data.max_text_length 40 exceeds" in message and "pads every caption" in message
    assert "at most 16" in message
