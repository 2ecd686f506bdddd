"""The config-key table in docs/formats.md is the one the dataclasses make."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from pathlib import Path

from vltrain.config.job import JobConfig
from vltrain.config.reference import config_rows, config_table

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_table_is_the_generated_one():
    doc = (REPO / "docs" / "formats.md").read_text()
    assert _script().replace_table(doc, config_table()) == doc, \
        "docs/formats.md's config table is stale: run `PYTHONPATH=src python scripts/config_table.py --write`"


def test_every_key_is_in_the_table_with_a_meaning():
    def leaves(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from leaves(hints[f.name], f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    rows = {key: meaning for key, _, _, meaning in config_rows()}
    assert list(rows) == list(leaves(JobConfig))
    assert {"data.jpeg_draft_ratio", "model.loss.contrastive_impl", "train.deterministic"} <= rows.keys()
    assert all(rows.values()), [k for k, m in rows.items() if not m]
