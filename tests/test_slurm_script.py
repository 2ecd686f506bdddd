"""scripts/slurm/train.sbatch under stand-ins for srun and scontrol: USR1 near the time limit
reaches the workers, they checkpoint the step they are on, and the script requeues the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kits.multiproc import free_port
from kits.runkit import overrides, session_shapes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "train.sbatch"
STAND_INS = {
    "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',  # drop srun's options, run the task
    "torchrun": f'exec {sys.executable} -m torch.distributed.run "$@"',
    "python": f'exec {sys.executable} "$@"',
    "scontrol": 'if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> "$SCONTROL_LOG"; fi',
}


@pytest.mark.timeout(240)
def test_usr1_to_the_batch_script_checkpoints_and_requeues(tmp_path_factory, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    shapes, run = session_shapes(tmp_path_factory), tmp_path / "run"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node1", SLURM_JOB_ID="123",
               SLURM_JOB_NUM_NODES="1", SLURM_GPUS_ON_NODE="2", RDZV_PORT=str(free_port()),
               SCONTROL_LOG=str(tmp_path / "scontrol.log"), OMP_NUM_THREADS="1")
    args = overrides(shapes, run, train__max_steps=400, train__log_every=1, checkpoint__every=0)
    proc = subprocess.Popen(["bash", str(SCRIPT), str(shapes / "base.yaml"), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # the workers are training: the time limit is near
            if line.startswith("step 3/") or time.monotonic() > deadline:
                break
        os.kill(proc.pid, signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    marker = json.loads((run / "preempted.json").read_text())
    assert 3 <= marker["step"] < 400
    assert (run / "checkpoints" / f"step-{marker['step']}" / "state.json").exists()
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "123"]
    assert "requeueing" in out
