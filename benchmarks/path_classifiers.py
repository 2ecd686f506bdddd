"""The functions that decide what kind of path they were given (a run, a checkpoint, an export, a
Hugging Face folder, an OpenCLIP file).

Read from the source, without importing it. A function counts when its own body (nested functions
apart) tests a path for a file that marks a kind (``config.yaml``, ``config.json``, ``state.json``,
``model.safetensors``, a ``checkpoints`` folder, a checkpoint file suffix), or calls such a test
whose name starts with ``is_`` (``is_exported(p)``, ``is_complete(p)``). Prints one line per
function and the count.

    python benchmarks/path_classifiers.py [SRC_DIR]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MARKERS = ("config.yaml", "config.json", "state.json", "model.safetensors", "CONFIG_FILE", "STATE_FILE",
           "WEIGHTS_FILE", "CHECKPOINT_SUFFIXES", "'checkpoints'", '"checkpoints"', "HF_CONFIG")
TESTS = ("is_file", "is_dir", "exists", "suffix", "name")


def own_nodes(fn: ast.AST):
    """Every node of ``fn``'s body, not descending into nested functions."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def tests_a_marker(fn: ast.AST, text: str) -> bool:
    for node in own_nodes(fn):
        if isinstance(node, ast.Attribute) and node.attr in TESTS:
            parent_src = ast.get_source_segment(text, node.value) or ""
            if any(m in parent_src for m in MARKERS):
                return True
        if isinstance(node, ast.Compare):
            src = ast.get_source_segment(text, node) or ""
            if any(f".{t}" in src for t in ("suffix", "name")) and any(m in src for m in MARKERS):
                return True
    return False


def functions(src: Path):
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield f"{module}.{node.name}.{item.name}", item, text
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.col_offset == 0:
                yield f"{module}.{node.name}", node, text


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src")
    found = {name for name, fn, text in functions(src) if tests_a_marker(fn, text)}
    predicates = {name.rpartition(".")[2] for name in found if name.rpartition(".")[2].startswith("is_")}
    for name, fn, _ in functions(src):
        calls = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                 for n in own_nodes(fn) if isinstance(n, ast.Call)}
        if calls & predicates:
            found.add(name)
    for name in sorted(found):
        print(name)
    print(f"{len(found)} functions classify a path")


if __name__ == "__main__":
    main()
