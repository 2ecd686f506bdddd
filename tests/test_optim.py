"""Decay exemptions, freezing and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vltrain.config import TrainConfig
from vltrain.errors import ConfigError
from vltrain.optim import WarmupCosine, build_optimizer, build_scheduler, freeze_towers, param_groups


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.text = nn.Embedding(10, 4)
        self.pos_embed = nn.Parameter(torch.zeros(1, 3, 4))
        self.proj = nn.Linear(4, 4, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))


def names_of(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_no_decay_on_norms_biases_embeddings_temperature():
    model = Towers()
    decay, no_decay = param_groups(model, 0.1)
    assert names_of(model, decay) == {"vision.0.weight", "proj.weight"}
    assert names_of(model, no_decay) == {
        "vision.0.bias", "vision.1.weight", "vision.1.bias", "text.weight", "pos_embed", "logit_scale"
    }
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_freeze_tower_leaves_it_out_and_unchanged():
    model = Towers()
    freeze_towers(model, ["vision"])
    opt = build_optimizer(model, TrainConfig(lr=0.1))
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) not in trained for p in model.vision.parameters())
    before = model.vision[0].weight.clone()
    loss = model.vision(torch.randn(2, 4)).sum() + model.proj.weight.sum() + model.logit_scale
    loss.backward()
    opt.step()
    assert torch.equal(model.vision[0].weight, before)


def test_freeze_unknown_tower_is_a_config_error():
    with pytest.raises(ConfigError, match="not a tower"):
        freeze_towers(Towers(), ["audio"])


def test_warmup_then_cosine():
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    assert f(0) < f(5) < f(9) < 1.0
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_scheduler_state_round_trips():
    model = Towers()
    cfg = TrainConfig(lr=1.0, warmup_steps=3, max_steps=20)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer(Towers(), cfg)
    sched2 = build_scheduler(opt2, cfg)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert sched.get_last_lr()[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 17)))


class _CudaLike:
    """Stands in for a parameter on a CUDA device (this build has none)."""

    def __init__(self, floating: bool = True):
        self.is_cuda, self._floating = True, floating

    def is_floating_point(self) -> bool:
        return self._floating


def test_fused_adamw_only_when_every_parameter_is_cuda_floating_point():
    from vltrain.optim import implementation

    cpu = nn.Parameter(torch.zeros(2))
    assert implementation([{"params": [_CudaLike(), _CudaLike()]}]) == {"fused": True}
    assert implementation([{"params": [_CudaLike()]}, {"params": [cpu]}]) == {"foreach": True}
    assert implementation([{"params": [_CudaLike(floating=False)]}]) == {"foreach": True}
    assert implementation([{"params": [cpu]}]) == {"foreach": True}
    opt = build_optimizer(Towers(), TrainConfig())
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
