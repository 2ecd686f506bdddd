"""ModelConfig validation through the job config loader."""

from __future__ import annotations

import pytest

from vltrain import errors
from vltrain.config import job as config


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.preset=clip-vit-b99", "clip-vit-b32"),
        ("model.text.pooling=max", "first, eos, mean, last or appended"),
        ("model.loss.itm=-1", "model.loss.itm"),
        ("model.loss.mlm_probability=1.5", "mlm_probability"),
        ("model.teacher.precomputed=true", "model.teacher.path names no teacher"),
    ],
)
def test_bad_model_config_names_the_key(override, message):
    with pytest.raises(errors.ConfigError, match=message):
        config.load_config(None, [override])


def test_itc_and_siglip_cannot_both_be_off():
    with pytest.raises(errors.ConfigError, match="set itc, siglip, distill or distill_sigmoid > 0"):
        config.load_config(None, ["model.loss.itc=0"])
    only_distillation = config.load_config(None, ["model.loss.itc=0", "model.loss.distill=1", "model.teacher.path=t"])
    assert only_distillation.model.loss.distill == 1
    # a captioner may train its caption loss alone (BLIP's has no contrastive parts), not a model without one
    assert config.load_config(None, ["model.preset=tiny-coca", "model.loss.itc=0"]).model.loss.caption == 2
    with pytest.raises(errors.ConfigError, match="unless it captions"):
        config.load_config(None, ["model.preset=tiny-coca", "model.loss.itc=0", "model.loss.caption=0"])


def test_presets_load():
    cfg = config.load_config(None, ["model.preset=albef-base", "model.loss.mlm=0.5"])
    assert cfg.model.preset == "albef-base" and cfg.model.loss.mlm == 0.5



def test_last_pooling_is_refused_where_the_last_position_is_padding():
    # the tower pads to each batch's longest caption: "last" would read padding that moves with the
    # batch, and a caption would embed differently on another number of ranks
    from vltrain.model import build_model
    from vltrain.model.config import ModelConfig, TextConfig

    cfg = ModelConfig(preset="tiny-clip", text=TextConfig(pooling="last"))
    with pytest.raises(errors.ConfigError, match="pooling: last reads the last position"):
        build_model(cfg, vocab_size=50, pad_id=0, mask_id=1, image_size=32, max_text_length=8)
