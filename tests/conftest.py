"""Shared fixtures, and the rule that marks a test slow. Subprocesses (CLI, torchrun) must import
this checkout's vltrain.

**Slow, automatically.** A test that starts a process is marked ``slow`` at collection: a process
costs seconds of start-up and imports before any work (the CLI, torchrun, spawned gloo ranks).
The rule reads bytecode, not names. A test is slow when its function (or its class, read whole),
a fixture it uses, or any function or class under ``tests/`` that those refer to (the module's
helpers, ``kits/``, a fixture's inner function), refers to one of ``LAUNCHERS``: ``subprocess.run``,
``Popen`` and the like, ``os.fork``/``exec*``/``spawn*``, ``multiprocessing``'s and
``torch.multiprocessing``'s process starters, a process pool. So the ``cli`` fixture,
``kits.runkit.train``/``start``/``reference`` and ``kits.multiproc.run_world`` make a test slow, and
so will a new helper that starts a process, with no list to keep. This module's own functions (the
rule) are not read through; its fixtures are, as fixtures.

What it does not see: a process started inside vltrain or a library (DataLoader workers, an index
build's pool), and a test that is slow for its own sake (long in-process training). Those keep a
hand-written ``@pytest.mark.slow``. ``pytest --collect-only -q -m slow`` lists what both select;
``tests/test_slow_rule.py`` checks the rule on small cases.
"""

from __future__ import annotations

import atexit
import builtins
import concurrent.futures
import dis
import importlib
import inspect
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = str(TESTS.parent / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)
os.environ["PYTHONPATH"] = SRC + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's own user cache (shard indexes, the CPU's matmul peak): a peak timed while the suite keeps
# the cores busy would otherwise be kept for the user's later runs, and read low there.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="vltrain-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


@pytest.fixture
def cli(tmp_path):
    """Run ``python -m vltrain ARGS`` as a process of its own (forked from one that has imported
    vltrain already, :mod:`kits.forkrun`); returns the CompletedProcess."""
    from kits import forkrun

    def run(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return forkrun.run(list(map(str, args)), timeout=timeout, cwd=cwd or tmp_path)

    return run


LAUNCHERS = {
    subprocess.run, subprocess.Popen, subprocess.call, subprocess.check_call, subprocess.check_output,
    subprocess.getoutput, subprocess.getstatusoutput,
    os.fork, os.forkpty, os.posix_spawn, os.posix_spawnp, os.spawnv, os.spawnve, os.spawnl,
    os.spawnle, os.spawnlp, os.spawnvp, os.execv, os.execve, os.execvp,
    multiprocessing.Process, multiprocessing.Pool, multiprocessing.get_context,
    concurrent.futures.ProcessPoolExecutor,
}
"""What starts a process; ``torch.multiprocessing``'s are added in ``_launchers``. ``os.system`` is
left out: the one test that names it holds it as a pickle payload that must never run."""


def _launchers() -> set:
    import torch.multiprocessing as tmp

    return LAUNCHERS | {tmp.spawn, tmp.start_processes, tmp.Process, tmp.get_context}


def _ours(obj) -> bool:
    """A function or class written under tests/ (read through); vltrain and libraries are not."""
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        return inspect.unwrap(obj).__code__.co_filename.startswith(str(TESTS))
    if isinstance(obj, type):
        return getattr(sys.modules.get(obj.__module__), "__file__", "").startswith(str(TESTS))
    return False


def _module(name: str) -> types.ModuleType | None:
    """The module a function imports: loaded now if it is a kit or a process starter's (importing
    anything else at collection could change what a test sees), else only if already loaded."""
    if name.split(".")[0] in ("kits", "subprocess", "multiprocessing", "concurrent", "os", "torch"):
        try:
            return importlib.import_module(name)
        except ImportError:
            return None
    return sys.modules.get(name)


def _referenced(code: types.CodeType, namespace: dict, enclosing: dict | None = None):
    """Every object ``code`` (and the functions, lambdas and classes nested in it) loads by name: a
    global, an attribute of a module, or what ``import``/``from ... import`` binds."""
    local: dict[str, object] = dict(enclosing or {})  # a closure reads what its function bound
    last = imported = None
    for ins in dis.get_instructions(code):
        op, name = ins.opname, ins.argval
        if op.startswith("LOAD_FAST") and isinstance(name, tuple):  # LOAD_FAST_LOAD_FAST (3.13)
            name = name[-1]
        if op in ("LOAD_GLOBAL", "LOAD_NAME"):
            last = namespace[name] if name in namespace else getattr(builtins, name, None)
        elif op.startswith("LOAD_FAST") or op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
            last = local.get(name)
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            last = getattr(last, name, None) if isinstance(last, types.ModuleType) else None
        elif op == "IMPORT_NAME":
            imported = _module(name)
            # ``import a.b`` binds ``a``; ``from a.b import c`` reads ``a.b``
            last = imported if "." not in name else sys.modules.get(name.split(".")[0])
        elif op == "IMPORT_FROM":
            last = getattr(imported, name, None)
        elif op.startswith("STORE_") and op != "STORE_ATTR" and op != "STORE_SUBSCR":
            local[name] = last
            last = None
            continue
        else:
            last = None
            continue
        if last is not None:
            yield last
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _referenced(const, namespace, local)


_REFERENCES: dict = {}
"""What each function read so far refers to (:func:`_referenced`): the kits' helpers are read once
per session, not once per test that reaches them."""
_VERDICTS: dict = {}
""":func:`starts_processes`'s answer for each test function, class and fixture read so far."""


def _starts_processes(obj, launchers: set, seen: set) -> bool:
    """Whether ``obj`` (a function or class of tests/) reaches a launcher."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, type):
        return any(_starts_processes(v, launchers, seen) for v in vars(obj).values() if _ours(v))
    fn = inspect.unwrap(obj.__func__ if isinstance(obj, types.MethodType) else obj)
    if fn not in _REFERENCES:
        _REFERENCES[fn] = list(_referenced(fn.__code__, fn.__globals__))
    for ref in _REFERENCES[fn]:
        try:
            if ref in launchers:
                return True
        except TypeError:  # unhashable
            pass
        if _ours(ref) and getattr(ref, "__module__", None) != __name__ and _starts_processes(ref, launchers, seen):
            return True
    return False


def starts_processes(item: pytest.Function) -> bool:
    """Whether the test, its class or a fixture it uses starts a process (see the module docstring)."""
    launchers = _launchers()
    parts = [item.cls] if item.cls is not None else [item.obj]
    for name in item.fixturenames:
        parts += [d.func for d in item._fixtureinfo.name2fixturedefs.get(name, ())]
    for part in parts:
        if part not in _VERDICTS:  # each read from itself: a verdict reached inside a cycle is not kept
            _VERDICTS[part] = _ours(part) and _starts_processes(part, launchers, set())
    return any(_VERDICTS[p] for p in parts)


PROCESS_WEIGHT = 100
"""A test that starts processes takes about as long as a hundred that do not (20 s against 0.2 s)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark slow every test that starts a process (the rule: module docstring). First, because
    ``-m`` deselects in pytest's own ``pytest_collection_modifyitems``."""
    for item in items:
        if isinstance(item, pytest.Function) and starts_processes(item):
            item.add_marker(pytest.mark.slow)
    # The files that start most processes first (a test that starts one counts as PROCESS_WEIGHT plain
    # ones): each xdist worker takes the next file as it frees up, so the long files start early and
    # the short ones fill in at the end instead of one long file running alone on the last worker.
    # The Makefile's --no-loadscope-reorder keeps this order (xdist's own puts files with most tests first).
    weight: dict = {}
    for item in items:
        weight[item.path] = weight.get(item.path, 0) + (PROCESS_WEIGHT if item.get_closest_marker("slow") else 1)
    first = {path: i for i, path in enumerate(weight)}
    items.sort(key=lambda item: (-weight[item.path], first[item.path]))
