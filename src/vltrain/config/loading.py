"""Typed configs from YAML: dotted overrides, checking and coercion against a dataclass tree.

Nothing here knows the job's keys: :mod:`vltrain.config.job` gives its tree (``JobConfig``) to these
functions. Validation errors name the key, what was expected and what was given, and suggest the
closest valid keys, because a typo in a config should cost seconds, not a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from vltrain.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: by default the
    last wins, and a second ``model:`` section silently replaces the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (first on line "
                                  f"{seen[key]}); merge the two into one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping of sections, each key given once."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        raw = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{p}, {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def dotted_keys(raw: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key path of a nested mapping: ``data``, ``data.image_size``, ..."""
    out = []
    for k, v in raw.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out.extend(dotted_keys(v, f"{prefix}{k}."))
    return out


def _flow_list(text: str) -> Any:
    """``[a/{0..3}.tar, b/*.parquet]``, which YAML refuses (a brace opens a mapping there), as a
    list of strings split at the commas outside braces; any other text as it is."""
    inner = text.strip()
    if not (inner.startswith("[") and inner.endswith("]")):
        return text
    items, depth, start = [], 0, 1
    for k, c in enumerate(inner[1:-1], 1):
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            items.append(inner[start:k])
            start = k + 1
    items.append(inner[start:-1])
    return [x.strip().strip("'\"") for x in items if x.strip()]


def apply_override(root: type, raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict after checking the key against the dataclass tree ``root``;
    the value is parsed as YAML (so 3e-4, true, [1,2])."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value (e.g. train.lr=3e-4)")
    key, _, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {item!r} has an empty key part")
    _check_key_path(root, parts, key)
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = _flow_list(text)
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree, for suggestions and documentation."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        out.append(name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(all_keys(tp, name + "."))
    return out


def _suggest(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.5)
    if not close:
        last = key.rsplit(".", 1)[-1]
        close = [c for c in candidates if c.rsplit(".", 1)[-1] == last][:3]
    return f"; did you mean {', '.join(close)}?" if close else ""


def _check_key_path(root: type, parts: list[str], full: str) -> None:
    cur: Any = root
    for i, p in enumerate(parts):
        if not dataclasses.is_dataclass(cur):
            return  # inside a free-form value (a list or dict); its type is checked later
        hints = typing.get_type_hints(cur)
        if p not in hints:
            prefix = ".".join(parts[:i])
            raise ConfigError(
                f"unknown config key {full!r}" + _suggest(full, all_keys(root))
                + ("" if not prefix else f" (valid keys under {prefix}: {', '.join(hints) if hints else 'none'})")
            )
        cur = hints[p]


def from_dict(cls: type, raw: Any, path: str = "", root: type | None = None) -> Any:
    """Build dataclass ``cls`` from a nested dict, checking every key and type; an unknown key is
    matched against every key of ``root`` (the whole tree ``cls`` is part of) for a suggestion."""
    root = root or cls
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config key {path or '<root>'!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            full = f"{path}.{k}" if path else str(k)
            raise ConfigError(f"unknown config key {full!r}" + _suggest(full, all_keys(root)))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            full = f"{path}.{f.name}" if path else f.name
            kwargs[f.name] = _coerce(hints[f.name], raw[f.name], full, root)
    obj = cls(**kwargs)
    post = getattr(obj, "validate", None)
    if callable(post):
        post()
    return obj


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (a,) = typing.get_args(tp)
        return f"list of {type_name(a)}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({', '.join(f.name for f in dataclasses.fields(tp))})"
    return getattr(tp, "__name__", str(tp))


def _bad(tp: Any, value: Any, key: str) -> ConfigError:
    return ConfigError(f"config key {key!r} expects {type_name(tp)}, got {value!r} ({type(value).__name__})")


def _coerce(tp: Any, value: Any, key: str, root: type) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _bad(tp, value, key)
    if origin in (Union, types.UnionType):
        return _coerce_union(tp, value, key, root)
    if origin is list:
        (a,) = typing.get_args(tp)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise _bad(tp, value, key)
        return [_coerce(a, v, f"{key}[{i}]", root) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(tp, value, key)
        _, vt = typing.get_args(tp)
        return {str(k): _coerce(vt, v, f"{key}.{k}", root) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _bad(tp, value, key)
        return from_dict(tp, value, key, root)
    return _coerce_scalar(tp, value, key)


def _coerce_union(tp: Any, value: Any, key: str, root: type) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return _coerce(a, value, key, root)
        except ConfigError as e:
            errors.append(e)
    # one candidate type: its own message is the most precise
    non_none = [a for a in args if a is not type(None)]
    if len(non_none) == 1 and errors:
        raise errors[0]
    raise _bad(tp, value, key)


def _coerce_scalar(tp: Any, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "3e-4" (no dot) as a string
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise _bad(tp, value, key)
