"""The config keys as a table (docs/formats.md#config-keys), made from the dataclasses themselves:
each key's type, default and the docstring under its field, so the documentation cannot drift
from the code (``tests/config/test_reference.py`` fails when the table in the docs is stale;
``python scripts/config_table.py --write`` rewrites it)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

import yaml

from vltrain.config.job import JobConfig
from vltrain.config.loading import type_name

HEADER = "| key | type | default | meaning |\n|---|---|---|---|\n"


def field_docs(cls: type) -> dict[str, str]:
    """The string under each field of dataclass ``cls`` (attribute docstrings), on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _shown(value: Any) -> str:
    """A default as it is written in YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def config_rows(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every leaf key under ``cls``, in declaration order."""
    hints, docs, rows = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += config_rows(tp, key + ".")
            continue
        rows.append((key, type_name(tp), _shown(_default(f)), docs.get(f.name, "")))
    return rows


def config_table() -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    return HEADER + "".join(f"| `{k}` | {cell(t)} | `{d}` | {cell(m)} |\n" for k, t, d, m in config_rows())
