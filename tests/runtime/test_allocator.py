"""The ``vltrain`` command starts again on TCMalloc where the system has it (VLTRAIN_MALLOC)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vltrain.errors import ConfigError
from vltrain.runtime import allocator

REPO = Path(__file__).resolve().parents[2]
PROBE = "from vltrain.runtime import allocator; allocator.restart_with_tcmalloc(); print(allocator.loaded())"


def _process(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (allocator.ENV, allocator.STARTED, "LD_PRELOAD")}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                          env=dict(base, PYTHONPATH=str(REPO / "src"), **env))


def test_a_process_restarts_on_tcmalloc_where_the_system_has_it_and_on_glibc_when_told():
    auto = _process({})
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.strip() == ("tcmalloc" if allocator.find_tcmalloc() else "glibc")
    told = _process({allocator.ENV: "glibc"})
    assert told.returncode == 0, told.stderr
    assert told.stdout.strip() == "glibc"


def test_a_wrong_choice_is_one_line_naming_the_variable():
    done = subprocess.run([sys.executable, "-m", "vltrain", "data", "--help"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO / "src"), **{allocator.ENV: "fast"}))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "vltrain: error: VLTRAIN_MALLOC='fast': use one of auto, tcmalloc, glibc"]


class Exec(Exception):
    """Raised in place of ``os.execve``, carrying what it was given."""


@pytest.fixture
def execs(monkeypatch):
    def record(path, argv, env):
        raise Exec(path, argv, env)

    monkeypatch.setattr(allocator.os, "execve", record)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as at the command's start
    for name in (allocator.ENV, allocator.STARTED, "LD_PRELOAD", "CONDA_PREFIX", "LD_LIBRARY_PATH",
                 "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _library(folder: Path, name: str = "libtcmalloc_minimal.so.4") -> str:
    (folder / "lib").mkdir(parents=True, exist_ok=True)
    (folder / "lib" / name).write_bytes(b"")
    return str(folder / "lib" / name)


def test_the_restart_preloads_the_library_before_the_users_own_and_marks_itself(execs, tmp_path):
    library = _library(tmp_path)
    execs.setenv("CONDA_PREFIX", str(tmp_path))
    execs.setenv("LD_PRELOAD", "libfaketime.so.1")
    with pytest.raises(Exec) as done:
        allocator.restart_with_tcmalloc()
    path, argv, env = done.value.args
    assert (path, argv) == (sys.executable, sys.orig_argv)
    assert env["LD_PRELOAD"] == f"{library} libfaketime.so.1"
    assert env[allocator.STARTED] == "1"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40


@pytest.mark.parametrize("setting", [{allocator.STARTED: "1"}, {"LD_PRELOAD": "/opt/lib/libjemalloc.so.2"},
                                     {allocator.ENV: "glibc"}])
def test_no_restart_once_started_under_a_preloaded_allocator_or_on_glibc_by_choice(execs, tmp_path, setting):
    _library(tmp_path)
    execs.setenv("CONDA_PREFIX", str(tmp_path))
    for key, value in setting.items():
        execs.setenv(key, value)
    allocator.restart_with_tcmalloc()  # returns: no Exec


def test_a_process_that_loaded_torch_is_not_started_again(execs, tmp_path):
    """A fork of a process with torch loaded (a test's fork server) has allocated on glibc already,
    and its command line is its parent's."""
    _library(tmp_path)
    execs.setenv("CONDA_PREFIX", str(tmp_path))
    execs.setitem(sys.modules, "torch", object())
    allocator.restart_with_tcmalloc()  # returns: no Exec


def test_tcmalloc_asked_for_and_missing_says_how_to_install_it(execs, tmp_path):
    execs.setattr(allocator, "library_dirs", lambda: [str(tmp_path)])
    execs.setenv(allocator.ENV, "tcmalloc")
    with pytest.raises(ConfigError, match="libtcmalloc-minimal4.*VLTRAIN_MALLOC=glibc"):
        allocator.restart_with_tcmalloc()
    execs.setenv(allocator.ENV, "auto")
    allocator.restart_with_tcmalloc()  # nothing to preload: glibc, no Exec
    assert "libtcmalloc-minimal4" in allocator.describe() and "model.text.pack_multiple=64" in allocator.describe()


def test_the_environments_own_library_comes_before_the_systems(execs, tmp_path):
    library = _library(tmp_path, "libtcmalloc.so.4")
    execs.setenv("CONDA_PREFIX", str(tmp_path))
    assert allocator.find_tcmalloc() == library
