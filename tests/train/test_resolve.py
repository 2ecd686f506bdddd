"""A run's config is decided in one pass before anything is built, frozen, and saved once: the saved
config.yaml is the config the run used."""

from __future__ import annotations

import pytest
from kits.runkit import overrides, session_shapes, train_here

from vltrain.checkpoint.paths import latest_checkpoint
from vltrain.config.job import load_config
from vltrain.data.dataset import build_dataset
from vltrain.errors import ConfigError
from vltrain.compose.builders import build_tokenizer
from vltrain.compose.decide import decide


def test_the_pass_decides_what_the_model_and_the_world_imply_without_building_a_model(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    raw = load_config(None, overrides(shapes, tmp_path / "run", data__resize="native", data__max_patches=8,
                                      data__global_batch_size=8))
    as_loaded = raw.to_yaml()
    resolved = decide(raw, world_size=2)
    cfg = resolved.cfg
    assert raw.to_yaml() == as_loaded  # the pass decides a copy: the config it was given is left as it was
    assert cfg.data.patch_size == 16  # tiny-clip's patches: the data knows it before any model exists
    # a dual encoder has no fusion heads and no decoder: the weights it cannot train say 0 in the saved config
    assert (cfg.model.loss.itm, cfg.model.loss.mlm, cfg.model.loss.caption) == (0.0, 0.0, 0.0)
    assert (cfg.data.batch_size, cfg.train.accumulation) == (4, 1) and resolved.batch.startswith("global batch 8 =")
    with pytest.raises(AttributeError, match="DataConfig.batch_size: the config is decided and frozen"):
        cfg.data.batch_size = 2
    with pytest.raises(AttributeError, match="LossConfig.itc: the config is decided and frozen"):
        cfg.model.loss.itc = 0.5
    dataset = build_dataset(cfg.data, "train", build_tokenizer(cfg))  # native: planned from the config alone
    assert len(dataset) > 0


def test_the_itm_group_is_decided_before_the_run_and_the_saved_config_is_the_one_used(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    cfg = load_config(None, overrides(shapes, tmp_path / "run", model__preset="tiny-albef", model__loss__itm=0.5,
                                      data__global_batch_size=8, train__max_steps=4, checkpoint__every=0,
                                      data__num_workers=0))
    trainer = train_here(cfg)
    loss = trainer.cfg.model.loss
    assert (loss.itm_negatives, loss.itm_group_size) == ("group", 2)  # auto under a global batch of 8
    assert trainer.objectives.itm_group_size == 2 and trainer.itm_source == "the default for a global batch of 8"
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert saved == trainer.cfg.to_yaml()
    assert (latest_checkpoint(tmp_path / "run" / "checkpoints") / "config.yaml").read_text() == saved
    assert load_config(tmp_path / "run" / "config.yaml").model.loss.itm_group_size == 2


def test_a_weight_asked_for_a_head_the_model_lacks_is_refused_and_one_in_a_file_is_left_at_0(tmp_path):
    """On the command line it is a demand the model cannot meet; a config file's loss section may serve
    several presets (configs/demo.yaml's itm weight, for a preset with ITM)."""
    with pytest.raises(ConfigError, match=r"model.loss.caption=2 needs a captioning decoder; model.loss.itm=1 needs "
                                          r"a fusion encoder, which tiny-clip has not: .*Set model.loss.caption=0 "
                                          r"model.loss.itm=0, or use a preset that has both \(tiny-coca-itm\)"):
        decide(load_config(None, ["model.loss.caption=2", "model.loss.itm=1"]), 1)
    with pytest.raises(ConfigError, match=r"model.loss.mlm=0.5 needs a fusion encoder, which tiny-coca has not"):
        decide(load_config(None, ["model.preset=tiny-coca", "model.loss.mlm=0.5"]), 1)
    yaml = tmp_path / "job.yaml"
    yaml.write_text("model:\n  loss:\n    caption: 0.5\n    itm: 0.25\n")
    cfg = decide(load_config(yaml, ["model.preset=tiny-clip"]), 1).cfg
    assert (cfg.model.loss.caption, cfg.model.loss.itm) == (0.0, 0.0)
