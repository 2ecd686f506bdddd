"""Decay exemptions, freezing and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vltrain.config.job import TrainConfig
from vltrain.errors import ConfigError
from vltrain.train.optim import WarmupCosine, build_optimizer, build_scheduler, freeze_towers, param_groups


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


def test_fused_adamw_for_floating_point_parameters_on_one_device():
    from vltrain.train.optim import implementation

    cpu, meta = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))
    assert implementation([{"params": [cpu]}, {"params": [nn.Parameter(torch.ones(3))]}]) == {"fused": True}
    assert implementation([{"params": [cpu]}, {"params": [meta]}]) == {"foreach": True}  # two devices
    assert implementation([{"params": [meta]}]) == {"foreach": True}  # no fused kernel there
    assert implementation([{"params": [torch.zeros(2, dtype=torch.long)]}]) == {"foreach": True}
    opt = build_optimizer(Towers(), TrainConfig())
    assert opt.defaults["fused"] and not opt.defaults["foreach"]


def test_fused_and_foreach_adamw_agree_and_a_resume_keeps_the_saved_one():
    """The same update to rounding; a checkpoint saved by one implementation resumes with it."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    finals, states = {}, {}
    for kind in ("fused", "foreach"):
        params = [nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{kind: True})
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        finals[kind], states[kind] = params, opt.state_dict()
    for a, b in zip(finals["fused"], finals["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    resumed = build_optimizer(Towers(), TrainConfig())
    saved = resumed.state_dict()  # as a run that used foreach saved it
    saved["param_groups"] = [{**g, "fused": None, "foreach": True} for g in saved["param_groups"]]
    resumed.load_state_dict(saved)
    assert all(g["foreach"] and not g["fused"] for g in resumed.param_groups)


# ---------------------------------------------------------------------------------------------
# Layer-wise lr decay and partial unlocking (fine-tuning)


def lrs_by_name(model, opt) -> dict[str, float]:
    return {n: g["lr"] for g in opt.param_groups for n in names_of(model, g)}


def test_layer_decay_scales_each_stack_from_its_own_depth():
    from kits.modelkit import small_model

    # vision: 3 blocks (top layer 4); text: 3 blocks + 1 fusion block on top (top layer 5)
    model = small_model("tiny-albef", itm=1.0)
    opt = build_optimizer(model, TrainConfig(lr=2.0, layer_decay=0.5))
    got = lrs_by_name(model, opt)

    def want(name: str) -> float:
        parts = name.split(".")
        if parts[0] in ("vision", "text") and parts[1] == "blocks":
            return 2.0 * 0.5 ** ((4 if parts[0] == "vision" else 5) - (int(parts[2]) + 1))
        if parts[0] == "fusion" and parts[1] == "blocks":
            return 2.0 * 0.5 ** (5 - 4)
        if parts[0] == "vision" and parts[1] != "norm":  # patch embedding, class token, positions, pre-norm
            return 2.0 * 0.5**4
        if parts[0] == "text" and parts[1] != "norm":  # token embedding, positions
            return 2.0 * 0.5**5
        return 2.0  # final norms, projections, temperature, ITM head

    assert got.keys() == {n for n, _ in model.named_parameters()}
    assert {n: lr for n, lr in got.items() if lr != want(n)} == {}
    assert got["vision.patch_embed.weight"] == 0.125 and got["text.token_embedding.weight"] == 0.0625
    assert got["vision.blocks.2.attn.qkv.weight"] == 1.0 and got["fusion.blocks.0.cross.q.weight"] == 1.0
    exempt = model.no_weight_decay()
    for g in opt.param_groups:
        assert {n in exempt for n in names_of(model, g)} == {g["weight_decay"] == 0.0}
        assert g["lr"] == 2.0 * g["lr_scale"]
    assert opt.param_groups[0]["lr_scale"] == 1.0  # the logged lr is the full one


def test_layer_decay_puts_siglips_attention_pool_on_top():
    """The attention-pool head sits above the vision tower's final norm: the full lr, not layer 0's."""
    from dataclasses import replace

    from vltrain.model.builder import build_model
    from vltrain.model.config import ModelConfig
    from vltrain.model.presets import PRESETS

    base = PRESETS["tiny-clip"]()
    arch = replace(base, vision=replace(base.vision, pooling="map", class_token=False))
    model = build_model(ModelConfig(preset="tiny-clip", arch=arch.to_dict()), vocab_size=64, pad_id=0, mask_id=None,
                        image_size=48, max_text_length=16)
    got = lrs_by_name(model, build_optimizer(model, TrainConfig(lr=2.0, layer_decay=0.5)))
    heads = [n for n in got if n.startswith("vision.head.")]
    assert heads and {got[n] for n in heads} == {2.0}
    assert got["vision.patch_embed.weight"] == 2.0 * 0.5**4


def test_scheduler_multiplies_each_scaled_groups_lr():
    from kits.modelkit import small_model

    cfg = TrainConfig(lr=1.0, layer_decay=0.5, warmup_steps=4, max_steps=20)
    opt = build_optimizer(small_model("tiny-clip"), cfg)
    sched = build_scheduler(opt, cfg)
    for _ in range(6):
        opt.step()
        sched.step()
    factor = WarmupCosine(4, 20)(6)
    assert [g["lr"] for g in opt.param_groups] == [g["lr_scale"] * factor for g in opt.param_groups]
    assert {g["lr_scale"] for g in opt.param_groups} == {1.0, 0.5, 0.25, 0.125, 0.0625}  # 3 blocks a tower


def test_layer_decay_one_keeps_the_two_plain_groups():
    from kits.modelkit import small_model

    model = small_model("tiny-clip")
    plain = param_groups(model, 0.1)
    assert [sorted(g) for g in plain] == [["params", "weight_decay"]] * 2
    assert [len(g["params"]) for g in plain] == [len(g["params"]) for g in param_groups(model, 0.1, 1.0)]


def test_layer_decay_needs_a_model_that_names_its_layers():
    with pytest.raises(ConfigError, match="layer_decay needs a model that names its layers"):
        build_optimizer(Towers(), TrainConfig(layer_decay=0.7))


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_unlock_last_blocks_of_a_frozen_tower():
    from kits.modelkit import small_model

    model = small_model("tiny-clip")
    freeze_towers(model, ["vision"], 2)
    vision = {n for n in trainable(model) if n.startswith("vision.")}
    assert {n.split(".")[1] + (n.split(".")[2] if n.startswith("vision.blocks.") else "") for n in vision} == {
        "blocks1", "blocks2", "norm"}
    assert all(p.requires_grad for p in model.text.parameters())

    model = small_model("tiny-clip")
    freeze_towers(model, ["vision", "text"], {"text": 1})
    assert not any(n.startswith("vision.") for n in trainable(model))
    assert {n.split(".")[1] for n in trainable(model) if n.startswith("text.")} == {"blocks", "norm"}
    assert all(n.startswith("text.blocks.2.") for n in trainable(model) if n.startswith("text.blocks."))

    model = small_model("tiny-clip")
    freeze_towers(model, ["vision"], 0)
    assert not any(n.startswith("vision.") for n in trainable(model))


def test_unlock_more_blocks_than_a_tower_has_is_a_config_error():
    from kits.modelkit import small_model

    with pytest.raises(ConfigError, match="last 4 blocks of 'vision', which has 3; give at most 3"):
        freeze_towers(small_model("tiny-clip"), ["vision"], 4)
    with pytest.raises(ConfigError, match="which has 0"):
        freeze_towers(small_model("tiny-clip"), ["image_proj"], 1)


@pytest.mark.parametrize("overrides, message", [
    (["train.layer_decay=0"], r"train.layer_decay must be in \(0, 1\]"),
    (["train.layer_decay=1.5"], r"train.layer_decay must be in \(0, 1\]"),
    (["train.unlock_last=2"], "train.freeze, which is empty"),
    (["train.freeze=[vision]", "train.unlock_last=-1"], "must be >= 0 blocks"),
    (["train.freeze=[vision]", "train.unlock_last={text: 1}"], "names text, not in train.freeze"),
    (["checkpoint.save_initial=yes"], "checkpoint.save_initial"),
])
def test_fine_tuning_keys_are_checked_when_loaded(overrides, message):
    from vltrain.config.job import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_warmup_as_a_fraction_of_the_run():
    assert TrainConfig(warmup_steps=0.1, max_steps=40).warmup() == 4
    assert TrainConfig(warmup_steps=0.05, max_steps=1000).warmup() == 50
    assert TrainConfig(warmup_steps=100, max_steps=40).warmup() == 100
    with pytest.raises(ConfigError):
        TrainConfig(warmup_steps=-0.1).validate()


def test_a_warmup_longer_than_half_the_run_is_said(caplog):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING", logger="vltrain.train.optim"):
        build_scheduler(opt, TrainConfig(lr=1.0, warmup_steps=100, max_steps=40))
    assert "train.warmup_steps=100 is 100 of train.max_steps=40 steps" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="vltrain.train.optim"):
        sched = build_scheduler(opt, TrainConfig(lr=1.0, warmup_steps=0.1, max_steps=40))
    assert caplog.text == ""
    for _ in range(4):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)  # the peak, reached at step 4 of 40
