"""LoRA on our towers (``vltrain.model.lora``): q, k and v adapted apart in a fused projection; fresh
adapters leave the output as it was; merged adapters give the adapted output in the plain layout;
only the adapters train; a target that matches nothing is named with what there is."""

from __future__ import annotations

import pytest
import torch
from kits.modelkit import make_batch, small_model

from vltrain.config.job import load_config
from vltrain.errors import ConfigError
from vltrain.model.lora import LoraSettings, add_adapters, merge_adapters

pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _embeds(model, batch):
    with torch.no_grad():
        out = model.encode(batch)
    return torch.cat([out.image_embeds, out.text_embeds])


@pytest.mark.parametrize("preset", ["tiny-clip", "tiny-siglip2"])
def test_adapters_start_at_the_models_output_and_merge_into_the_plain_layout(preset):
    model, batch = small_model(preset).eval(), make_batch(4)
    plain_keys = set(model.state_dict())
    before = _embeds(model, batch)
    names = add_adapters(model, LoraSettings(rank=2, targets=ALL))
    assert torch.equal(_embeds(model, batch), before)  # B starts at zero; the split q, k, v give the fused output
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(names)
    assert {n.rsplit(".", 1)[1] for n in names} == {"q_proj", "k_proj", "v_proj", "out", "fc", "proj"}

    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            p.data.normal_(std=0.1)
    adapted = _embeds(model, batch)
    assert not torch.allclose(adapted, before, atol=1e-3)
    merge_adapters(model)
    assert set(model.state_dict()) == plain_keys
    torch.testing.assert_close(_embeds(model, batch), adapted, rtol=1e-5, atol=1e-5)


def test_q_alone_changes_only_the_q_rows_of_the_fused_projection():
    model = small_model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    add_adapters(model, LoraSettings(rank=2, towers=["vision"], targets=["q_proj"], last_blocks=1))
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            p.data.fill_(0.5)
    merged = merge_adapters(model).state_dict()
    moved = {k for k in base if not torch.equal(base[k], merged[k])}
    last = len(model.vision.blocks) - 1
    assert moved == {f"vision.blocks.{last}.attn.qkv.weight"}
    w = merged[f"vision.blocks.{last}.attn.qkv.weight"]
    width = w.shape[1]
    assert not torch.equal(w[:width], base[f"vision.blocks.{last}.attn.qkv.weight"][:width])
    assert torch.equal(w[width:], base[f"vision.blocks.{last}.attn.qkv.weight"][width:])


def test_a_target_that_matches_nothing_names_what_there_is():
    model = small_model()
    with pytest.raises(ConfigError, match=r"train.lora.towers names 'fusion'.*its towers with blocks: vision, text"):
        add_adapters(model, LoraSettings(rank=2, towers=["fusion"]))
    with pytest.raises(ConfigError, match="train.lora.last_blocks=9, but vision has"):
        add_adapters(small_model(), LoraSettings(rank=2, last_blocks=9))
    with pytest.raises(ConfigError, match=r"'q_porj' is not a layer LoRA adapts \(did you mean 'q_proj'\?\); choose from"):
        load_config(None, ["train.lora.rank=2", "train.lora.targets=[q_porj]"])
    with pytest.raises(ConfigError, match="LoRA freezes every weight but the adapters already"):
        load_config(None, ["train.lora.rank=2", "train.freeze=[vision]"])
    with pytest.raises(ConfigError, match="train.lora.adapters=somewhere needs train.lora.rank"):
        load_config(None, ["train.lora.adapters=somewhere"])
