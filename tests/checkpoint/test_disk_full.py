"""A full disk while checkpointing, and a run folder that cannot be written: one message, a
documented exit code, and an exact resume afterwards (real training processes)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from kits.runkit import assert_resumed_exactly, finish, ok, overrides, session_shapes, start, train

from vltrain.checkpoint.space import NO_SPACE_EXIT, QuietWrites, no_space, space_warning

pytestmark = pytest.mark.slow


def run(shapes: Path, run_dir: Path, fault: str = "", **extra) -> subprocess.CompletedProcess:
    """``vltrain train`` in one process (torchrun adds its own report of a failed worker);
    checkpoints at steps 4 and 8 and at the end (10)."""
    cmd = [sys.executable, "-m", "vltrain", "train", str(shapes / "base.yaml"),
           *overrides(shapes, run_dir, data__num_workers=0, **extra)]
    return finish(start(cmd, fault), 180)


def assert_one_message(proc: subprocess.CompletedProcess, step: int, folder: Path, intact: str) -> None:
    assert proc.returncode == NO_SPACE_EXIT, proc.stderr[-4000:]
    line = next(x for x in proc.stderr.splitlines() if "could not be written" in x)
    assert f"checkpoint of step {step} could not be written: {folder} has" in line
    assert f"{intact} is intact" in line and "checkpoint.keep" in line and "run.dir" in line
    assert "MB free" in line
    assert "Traceback" not in proc.stderr and "CheckpointException" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("could not be written") == 1


def mount_tmpfs(where: Path, size: str, *options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}", *options))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return mounted.returncode == 0


def test_enospc_while_saving_stops_with_one_message_and_resumes_exactly(tmp_path_factory, tmp_path):
    """A writer that fails with ENOSPC at step 8's commit (VLTRAIN_FAULT=nospace)."""
    shapes = session_shapes(tmp_path_factory)
    run_dir = tmp_path / "run"
    failed = run(shapes, run_dir, fault="nospace:at=save:step=8")
    assert_one_message(failed, 8, run_dir / "checkpoints", str(run_dir / "checkpoints" / "step-4"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-4"]  # no partial left
    resumed = ok(run(shapes, run_dir))
    assert_resumed_exactly(resumed, run_dir, 4)


def test_a_full_tmpfs_stops_with_one_message_and_resumes_after_growing(tmp_path_factory, tmp_path):
    """A real full disk: run.dir on a tmpfs that holds one checkpoint, not two (root only)."""
    shapes = session_shapes(tmp_path_factory)
    mnt = tmp_path / "mnt"
    probe = run(shapes, tmp_path / "probe", train__max_steps=4)  # the size of one checkpoint
    one = sum(f.stat().st_size for f in (tmp_path / "probe" / "checkpoints" / "step-4").rglob("*"))
    ok(probe)
    if not mount_tmpfs(mnt, f"{int(one * 1.6) // 4096 * 4096 + 65536}"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        failed = run(shapes, mnt / "run", train__log_every=1)
        assert_one_message(failed, 8, mnt / "run" / "checkpoints", str(mnt / "run" / "checkpoints" / "step-4"))
        assert "the next save may fail" in failed.stderr  # said before step 8's save
        subprocess.run(["mount", "-o", f"remount,size={one * 4}", str(mnt)], check=True)
        resumed = ok(run(shapes, mnt / "run"))
        assert_resumed_exactly(resumed, mnt / "run", 4)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@contextlib.contextmanager
def read_only(ro: Path) -> Iterator[Path]:
    """``ro`` made read-only while in the block: a read-only tmpfs for root (who may write
    anywhere), else a mode."""
    if os.geteuid() != 0:
        ro.mkdir()
        ro.chmod(0o555)
    elif not mount_tmpfs(ro, "1m", "ro"):
        pytest.skip("root, and no read-only tmpfs can be mounted")
    try:
        yield ro
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)])


def test_a_read_only_run_dir_stops_at_start_up(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    with read_only(tmp_path / "ro") as ro:
        proc = run(shapes, ro / "run")
    assert proc.returncode == NO_SPACE_EXIT, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "cannot be written" in x]
    assert len(lines) == 1, proc.stderr[-3000:]  # one message, said once
    assert lines[0].startswith(f"vltrain: error: run.dir {ro / 'run'} cannot be written (")
    assert "give a writable run.dir" in lines[0] and f"(exit code {NO_SPACE_EXIT})" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (ro / "run").exists()  # nothing written, not even the folder


def test_a_read_only_run_dir_stops_both_ranks_with_the_message(tmp_path_factory, tmp_path):
    """Under torchrun every rank checks the folder: each worker exits 74 with the same line (none
    waits for the other, none prints a traceback); torchrun's own summary names the code."""
    shapes = session_shapes(tmp_path_factory)
    with read_only(tmp_path / "ro") as ro:
        proc = train(shapes, ro / "run", torchrun=True)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("vltrain") and ": error: " in x]
    said = {x.split(": error: ", 1)[1] for x in lines}
    assert len(said) == 1, proc.stderr[-4000:]
    assert said.pop().startswith(f"run.dir {ro / 'run'} cannot be written (")
    assert f"exitcode  : {NO_SPACE_EXIT}" in proc.stderr  # a worker's code, in torchrun's summary
    assert "failed at step" not in proc.stderr and "[rank0]: Traceback" not in proc.stderr
    assert "[rank1]: Traceback" not in proc.stderr


def test_no_space_is_found_inside_dcp_failures_and_nothing_else_is():
    from torch.distributed.checkpoint.api import CheckpointException

    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert no_space(CheckpointException("save", {0: (short_write, None)})) is short_write
    full = OSError(errno.ENOSPC, "No space left on device")
    assert no_space(RuntimeError("wrapped")) is None
    try:
        raise RuntimeError("a later error") from full
    except RuntimeError as e:
        assert no_space(e) is full


def test_space_warning_names_retention(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    for step in (10, 20):
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "data").write_bytes(b"x" * 1000)
    monkeypatch.setattr("vltrain.checkpoint.space.free_bytes", lambda _: 500)
    line = space_warning(folder, [folder / "step-10", folder / "step-20"], keep=2)
    assert "500 B" not in line and "step-20" in line and "checkpoint.keep=2 deletes step-10" in line
    monkeypatch.setattr("vltrain.checkpoint.space.free_bytes", lambda _: 5000)
    assert space_warning(folder, [folder / "step-10", folder / "step-20"], keep=2) is None


def test_quiet_writes_report_once(capsys):
    quiet = QuietWrites()

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    quiet.run("metrics", full)
    quiet.run("curves.png", full)
    assert capsys.readouterr().err.count("not written") == 1
