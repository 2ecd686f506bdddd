"""The package's layers: every import, function-level ones included, points down one chain.

    errors -> types | pixels | images -> runtime -> data | model -> config -> objectives -> checkpoint
           -> compose -> export -> eval -> train -> demo -> cli

A module may import its own layer and any layer below it, never one above; ``data`` and ``model``
are side by side and import neither each other. ``compose`` (the decided config, the builders, the
task and the one door that opens a model) sits below every command that builds or opens a model
(export, eval, train), so nothing in ``checkpoint``, ``eval`` or ``export`` imports ``train``. ``objectives`` import no model class (only the
model's loss config): they score tensors. ``docs/architecture.md`` says why each layer sits
where it does.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "vltrain"

LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("types", "pixels", "images", "boxes", "views"),
    ("runtime",),
    ("data", "model"),
    ("config",),
    ("objectives",),
    ("checkpoint",),
    ("compose",),
    ("export",),
    ("eval",),
    ("train",),
    ("demo",),
    ("cli", "__main__", ""),
]
"""Module prefixes (below ``vltrain``) from the bottom up; a module belongs to its longest prefix."""

SIDE_BY_SIDE = ("data", "model")
"""One layer, two packages that import neither each other."""


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every vltrain module ``name`` imports, at any depth of its code, relative imports resolved."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = ["vltrain", *name.split(".")] if name else ["vltrain"]
                parts = parts if is_package else parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target != "vltrain" and not target.startswith("vltrain."):
                continue
            mod = target[len("vltrain."):] if target != "vltrain" else ""
            while mod and mod not in known:
                mod = mod.rpartition(".")[0]
            if mod != name and not (is_package and mod.startswith(name + ".")):
                found.add(mod)
    return found


def layer_of(name: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it)."""
    best = (-1, -1, "")
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix == "" and name == "" or prefix and (name == prefix or name.startswith(prefix + ".")):
                if len(prefix) > best[1]:
                    best = (i, len(prefix), prefix)
    assert best[0] >= 0, f"vltrain.{name} is in no layer: add its package to LAYERS"
    return best[0], best[2]


def upward_edges() -> list[str]:
    known = modules()
    bad = []
    for name, path in sorted(known.items()):
        here, side = layer_of(name)
        for target in sorted(imports(name, path, known)):
            there, other = layer_of(target)
            if there > here or there == here and {side, other} == set(SIDE_BY_SIDE):
                bad.append(f"vltrain.{name} (layer {side or 'vltrain'}) imports vltrain.{target} (layer {other})")
    return bad


def test_every_import_points_down_the_layers():
    assert upward_edges() == []


def test_what_opens_and_saves_models_imports_nothing_of_train():
    """The builders and the door sit in ``compose``: checkpoints, evaluation and export reach them
    without climbing into the trainer's package (``docs/architecture.md``, the layers)."""
    known = modules()
    found = sorted(f"vltrain.{name} imports vltrain.{target}" for name, path in known.items()
                   if name.split(".")[0] in ("checkpoint", "eval", "export", "compose")
                   for target in imports(name, path, known) if target.split(".")[0] == "train")
    assert found == []


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_the_schedule_rests_on_the_table_only():
    """The sampler, budgets, mixing and windows decide an epoch from per-row counts, nothing else."""
    known = modules()
    allowed = ("errors", "data.table", "data.config", "data.schedule")
    for name, path in known.items():
        if name.startswith("data.schedule"):
            for target in imports(name, path, known):
                assert target.startswith(allowed), f"vltrain.{name} imports vltrain.{target}"


OBJECTIVES_MAY_READ_OF_THE_MODEL = ("model.config",)
"""The objectives score tensors the model gives them (its passes reach them through
``types.ModelPasses``); of ``vltrain.model`` they read only the loss section of its config, plain data."""


def model_imports_of_the_objectives() -> list[str]:
    known = modules()
    return sorted(f"vltrain.{name} imports vltrain.{target}" for name, path in known.items()
                  if name == "objectives" or name.startswith("objectives.")
                  for target in imports(name, path, known)
                  if (target == "model" or target.startswith("model.")) and target not in OBJECTIVES_MAY_READ_OF_THE_MODEL)


def test_the_objectives_import_no_model_class():
    """docs/architecture.md: objectives score the model's outputs; they run no tower and import none."""
    assert model_imports_of_the_objectives() == []


def test_a_model_import_of_the_objectives_is_caught(tmp_path, monkeypatch):
    """The check itself: objectives that import the model class (at function level) are named."""
    fake = tmp_path / "vltrain"
    for package in ("objectives", "model"):
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "model" / "config.py").write_text("")
    (fake / "model" / "model.py").write_text("")
    (fake / "objectives" / "scoring.py").write_text(
        "from vltrain.model.config import LossConfig\n\ndef f():\n    from vltrain.model.model import VLModel\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert model_imports_of_the_objectives() == ["vltrain.objectives.scoring imports vltrain.model.model"]


def test_only_the_cli_parses_arguments():
    for name, path in modules().items():
        if name.startswith("cli"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert "argparse" not in names, f"vltrain.{name} imports argparse: parse arguments in vltrain.cli"


def test_the_cli_reaches_its_handlers_by_import():
    for name, path in modules().items():
        if name.startswith("cli"):
            assert "import_module" not in path.read_text(), f"vltrain.{name} imports a handler by name"


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The check itself: a data module that imports the trainer is named."""
    fake = tmp_path / "vltrain"
    (fake / "data").mkdir(parents=True)
    (fake / "train").mkdir()
    for f in ("__init__.py", "data/__init__.py", "train/__init__.py", "train/trainer.py"):
        (fake / f).write_text("")
    (fake / "data" / "loader.py").write_text("def f():\n    from vltrain.train.trainer import Trainer\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert upward_edges() == ["vltrain.data.loader (layer data) imports vltrain.train.trainer (layer train)"]
