"""Preemption: SIGTERM or SIGUSR1 ends the run with a checkpoint of the step it was on.

Slurm (``--signal=USR1@120``, or SIGTERM before its kill) and Kubernetes (SIGTERM, then SIGKILL
after the grace period) warn a job before stopping it. A handler here only notes the signal; the
ranks agree at the next step boundary (the flag rides in the step's one all-reduce, so a signal
that reached a single rank still stops them all at the same step), every rank writes the
checkpoint of that step, rank 0 writes ``RUN_DIR/preempted.json``, and the process exits with
``EXIT_CODE`` (75, EX_TEMPFAIL: try again later). Run the same command again to resume.

Under torchrun the agent receives the signal, forwards SIGTERM to the workers and kills them 30 s
later (torch's default), so the checkpoint must fit in that time; torchrun itself then exits 1,
which is why a requeue script looks for ``preempted.json`` (``scripts/slurm/train.sbatch``). A
second signal while the checkpoint is written changes nothing: the handler never raises, and the
checkpoint's commit is atomic anyway.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from vltrain.errors import UserError

EXIT_CODE = 75
MARKER = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(UserError):
    """The run stopped on a signal after saving a checkpoint: run the same command to resume."""

    exit_code = EXIT_CODE
    label = "stopped"


class PreemptionWatch:
    """Notes SIGTERM/SIGUSR1 (from the main thread's handlers); ``requested`` is 1.0 once one came."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._note)

    def _note(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> float:
        return float(self.signum is not None)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def write_marker(run_dir: Path, step: int, checkpoint: Path | None) -> None:
    (run_dir / MARKER).write_text(json.dumps({"step": step, "checkpoint": str(checkpoint or "")}) + "\n")


def clear_marker(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)
