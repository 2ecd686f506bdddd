"""The end of a run: every process group freed before the interpreter shuts down, and an exit code
that is the run's own, never a SIGABRT from a gloo thread (``World.close``, ``cli.main.leave``).

A gloo worker that drops a finished collective after the interpreter has begun to shut down aborts
the process (``terminate called without an active exception``), about one 2-rank run in 30. That
race cannot be hit on demand; what makes it possible can: a group whose threads are still running
when ``main`` returns. ``benchmarks/exit_codes.py`` counts the exits of hundreds of runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kits.multiproc import free_port
from kits.runkit import finish, overrides, session_shapes, start

HERE = Path(__file__).resolve().parent

CASES = {
    "ddp": {},
    "fsdp, async checkpoints": {"train__parallelism": "fsdp", "checkpoint__async_save": "true"},
    "budget batching, gradient caching": {"data__batching": "budget", "train__accumulation": 2,
                                          "train__contrastive_accumulation": "gradcache"},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_a_finished_run_leaves_no_process_group_running(tmp_path_factory, tmp_path, case):
    shapes = session_shapes(tmp_path_factory)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), str(HERE / "exit_probe.py"), "train", str(shapes / "base.yaml")]
    extra = {"train__max_steps": 4, "checkpoint__every": 2, **CASES[case]}
    proc = finish(start(launch + overrides(shapes, tmp_path / "run", **extra)), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    left = sorted(line for line in proc.stdout.splitlines() if "group threads left" in line)
    assert left == ["rank 0: group threads left: []", "rank 1: group threads left: []"], proc.stdout[-3000:]
    # the last step's checkpoint is committed, asynchronous or not
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-4"


def test_a_process_that_still_has_a_group_exits_with_its_code_after_its_exit_handlers(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    marker = tmp_path / "atexit.txt"
    proc = subprocess.run([sys.executable, str(HERE / "abort_probe.py"), "3", str(marker)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "pt_gloo_runloop" in proc.stdout  # the case leave() is for, flushed on the way out
    assert marker.read_text() == "exit handlers ran\n"
