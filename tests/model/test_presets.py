"""Presets build at the parameter counts documented in vltrain.model.presets."""

from __future__ import annotations

import re

import pytest
import torch

import vltrain.model.presets as presets
from vltrain.images import Images
from vltrain.errors import UserError
from vltrain.model import build_model, count_parameters, list_presets
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.objectives.scoring import Objectives
from vltrain.compose.task import Score, Task
from vltrain.types import ModelInputs


def documented() -> dict[str, tuple[int, int, int, int]]:
    """preset -> (vocab, length, image, parameters), parsed from the module docstring's table."""
    table = {}
    for line in presets.__doc__.splitlines():
        m = re.match(r"^(\S+)\s+.*?\s([\d,]+)\s+(\d+)\s+(\d+)\s+([\d,]+)\s*$", line)
        if m and m.group(1) in presets.PRESETS:
            vocab, length, image, params = (int(g.replace(",", "")) for g in m.groups()[1:])
            table[m.group(1)] = (vocab, length, image, params)
    return table


def test_every_preset_is_documented():
    assert set(documented()) == set(list_presets())
    assert {"tiny-clip", "tiny-albef", "clip-vit-b32", "clip-vit-b16", "clip-vit-l14", "albef-base"} <= set(list_presets())


@pytest.mark.parametrize("preset", list_presets())
def test_parameter_count_matches_the_table(preset):
    vocab, length, image, params = documented()[preset]
    cfg = ModelConfig(preset=preset)
    assert count_parameters(cfg, vocab_size=vocab, image_size=image, max_text_length=length) == params


def test_openclip_sizes():
    """ViT-B/32, B/16, L/14 have OpenCLIP's exact counts (at its 49408-token vocabulary, 77 tokens)."""
    table = documented()
    assert table["clip-vit-b32"][3] == 151_277_313
    assert table["clip-vit-b16"][3] == 149_620_737
    assert table["clip-vit-l14"][3] == 427_616_513


def test_tiny_preset_builds_and_runs_on_cpu():
    torch.manual_seed(0)
    vocab, length, image, params = documented()["tiny-clip"]
    model = build_model(ModelConfig(preset="tiny-clip"), vocab_size=vocab, pad_id=0, mask_id=None,
                        image_size=image, max_text_length=length)
    assert sum(p.numel() for p in model.parameters()) == params
    ids = torch.randint(1, vocab, (2, length))
    inputs = ModelInputs(Images(torch.randn(2, 3, image, image)), ids, torch.ones_like(ids), torch.ones(2, dtype=torch.bool),
                         torch.ones(2, dtype=torch.bool), torch.arange(2))
    out = Task(model, Objectives(LossConfig(), model.spec))(Score(inputs))
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)


def test_overrides_change_the_architecture():
    cfg = ModelConfig(preset="tiny-albef", embed_dim=64, loss=LossConfig(itm=0.0, mlm=0.0))
    with torch.device("meta"):
        model = build_model(cfg, vocab_size=100, pad_id=0, mask_id=1, image_size=64, max_text_length=8)
    assert model.image_proj.proj.out_features == 64
    assert model.fusion is None  # no objective needs it, so it is not built (it would get no gradient)
    assert model.vision.pos_embed.shape[0] == (64 // 16) ** 2 + 1


def test_bad_image_size_and_unknown_preset():
    with pytest.raises(UserError, match="patch size"):
        build_model(ModelConfig(preset="tiny-clip"), vocab_size=10, pad_id=0, mask_id=None, image_size=30,
                    max_text_length=8)
    with pytest.raises(UserError, match="unknown preset"):
        build_model(ModelConfig(preset="nope"), vocab_size=10, pad_id=0, mask_id=None, image_size=32,
                    max_text_length=8)


def test_a_written_out_architecture_reads_its_numbers_as_numbers():
    """model.arch as YAML 1.1 reads it: ``1e-05`` (no dot) arrives as a string; a word is refused by key."""
    arch = presets.tiny_siglip2().to_dict()
    arch["vision"]["norm_eps"], arch["text"]["width"] = "1e-05", 128.0
    read = presets.Architecture.from_dict(arch)
    assert read.vision.norm_eps == 1e-05 and isinstance(read.vision.norm_eps, float)
    assert read.text.width == 128 and isinstance(read.text.width, int)
    assert read == presets.tiny_siglip2()
    arch["decoder"]["heads"] = "four"
    with pytest.raises(UserError, match=r"model\.arch\.decoder\.heads expects int, got 'four'"):
        presets.Architecture.from_dict(arch)
    arch["decoder"]["heads"] = 4.5
    with pytest.raises(UserError, match=r"model\.arch\.decoder\.heads expects int, got 4\.5"):
        presets.Architecture.from_dict(arch)
