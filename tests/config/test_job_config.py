import pytest

from vltrain.config.job import JobConfig, load_config
from vltrain.errors import ConfigError
from vltrain.types import freeze


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  dir: runs/x\ntrain:\n  lr: 1.0e-3\ndata:\n  batch_size: 32\n")
    cfg = load_config(p, ["train.lr=3e-4", "data.batch_size=64", "train.precision=fp32"])
    assert isinstance(cfg, JobConfig)
    assert cfg.run.dir == "runs/x"
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.data.batch_size == 64
    assert cfg.train.precision == "fp32"


def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.lrr=1"])
    msg = str(e.value)
    assert "train.lrr" in msg and "train.lr" in msg

    p = tmp_path / "c.yaml"
    p.write_text("data:\n  batchsize: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "data.batchsize" in str(e.value) and "data.batch_size" in str(e.value)


def test_wrong_type_names_key_expected_and_given():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.batch_size=abc"])
    msg = str(e.value)
    assert "data.batch_size" in msg and "int" in msg and "abc" in msg
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.precision=fp8"])
    assert "'bf16'" in str(e.value) and "fp8" in str(e.value)


def test_sources_as_string_or_weighted_list():
    cfg = load_config(None, ["data.train=[{path: a.jsonl, weight: 2}, {path: b.jsonl}]"])
    assert [(s.path, s.weight) for s in cfg.data.train] == [("a.jsonl", 2.0), ("b.jsonl", 1.0)]
    cfg = load_config(None, ["data.train=a.jsonl"])
    assert cfg.data.train == "a.jsonl"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.max_steps=7", "data.train=x.jsonl"])
    with pytest.raises(ValueError, match="only a decided config is saved"):
        cfg.save(tmp_path / "config.yaml")  # one not yet decided is never what a folder says it used
    assert not (tmp_path / "config.yaml").exists()
    freeze(cfg).save(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and not list(tmp_path.glob("*.part"))


def test_validation_says_what_to_do():
    with pytest.raises(ConfigError, match="data.batch_size must be >= 1"):
        load_config(None, ["data.batch_size=0"])


def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(tmp_path):
    """By default PyYAML keeps the last of two equal keys: a second model: section would silently
    replace the first."""
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  preset: tiny-clip\ntrain:\n  max_steps: 3\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"job.yaml, line 6: key 'lr' is given twice \(first on line 5\)"):
        load_config(path)
    path.write_text("model:\n  preset: tiny-clip\ntrain:\n  max_steps: 3\nmodel:\n  preset: tiny-albef\n")
    with pytest.raises(ConfigError, match=r"line 5: key 'model' is given twice \(first on line 1\); merge"):
        load_config(path)
