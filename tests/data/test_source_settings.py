"""data.train / data.val as people write them: a string, a list of strings (YAML or a key=value
override, braces included), mappings, a mix of both, null; and a pattern that matches nothing."""

from __future__ import annotations

import pytest

from vltrain.data.config import SourceSpec


def _train(*overrides: str):
    from vltrain.config.job import load_config

    cfg = load_config("configs/demo.yaml", list(overrides))
    return cfg.data.train if isinstance(cfg.data.train, str) else \
        [(s.path, s.weight, s.display_name()) for s in cfg.data.train], cfg.data.val


def test_a_list_of_strings_is_one_source_each(monkeypatch):
    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])
    assert _train("data.train=[a/{00000..00003}.tar, hub/data/train-*.parquet]")[0] == [
        ("a/{00000..00003}.tar", 1.0, "a"), ("hub/data/train-*.parquet", 1.0, "train")]
    assert _train("data.train=['x.jsonl', \"y.csv\"]")[0] == [("x.jsonl", 1.0, "x"), ("y.csv", 1.0, "y")]
    assert _train("data.train=[{path: a.jsonl, weight: 2}, b.jsonl]")[0] == [("a.jsonl", 2.0, "a"), ("b.jsonl", 1.0, "b")]
    assert _train("data.train=s/{00000..00009}.tar")[0] == "s/{00000..00009}.tar"
    assert _train("data.val=null")[1] == "" and _train("data.val=")[1] == ""


def test_listed_strings_with_one_name_are_told_apart(monkeypatch):
    from vltrain.errors import ConfigError

    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])
    assert [n for *_, n in _train("data.train=[a/shards/{0..3}.tar, b/shards/{0..3}.tar]")[0]] == \
        ["shards-1", "shards-2"]
    with pytest.raises(ConfigError, match="sources need distinct names"):  # mappings name themselves
        _train("data.train=[{path: a/s.jsonl}, {path: b/s.jsonl}]")


def test_yaml_lists_of_strings(tmp_path):
    from vltrain.config.job import load_config

    (tmp_path / "c.yaml").write_text("data:\n  train:\n    - shards/{00000..00004}.tar\n"
                                     "    - hub/data/train-*.parquet\n  val: null\n")
    cfg = load_config(tmp_path / "c.yaml", [])
    assert [s.path for s in cfg.data.train] == ["shards/{00000..00004}.tar", "hub/data/train-*.parquet"]
    assert cfg.data.val == ""


@pytest.mark.parametrize("path,name", [("shards/{00000..00009}.tar", "shards"), ("d/train-*.parquet", "train"),
                                       ("d/train-{00000..00003}-of-00004.parquet", "train-"),
                                       ("s3://b/x/{a,b}.tar", "x"), ("m.jsonl", "m")])
def test_display_names_of_patterns(path, name):
    assert SourceSpec(path=path).display_name() == name.rstrip("-")


def test_a_pattern_matching_nothing_is_named(tmp_path):
    from vltrain.data.config import DataConfig
    from vltrain.data.dataset import build_dataset
    from vltrain.data.tokenizers import load_tokenizer
    from vltrain.data.tools.synth import synthesize, write_tokenizer
    from vltrain.errors import DataError

    synthesize(tmp_path / "s", 8, 0, seed=0, image_size=16)
    tok = load_tokenizer(write_tokenizer(tmp_path / "s", vocab_size=100))
    cfg = DataConfig(train=[str(tmp_path / "s" / "train.jsonl"), str(tmp_path / "hub" / "train-*.parquet")])
    with pytest.raises(DataError, match=r"data.train\[1\]: .*train-\*.parquet: no file matches .*train-\*.parquet"):
        build_dataset(cfg, "train", tok)
