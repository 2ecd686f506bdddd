"""Preemption and Ctrl-C: SIGTERM, SIGUSR1 or SIGINT ends the run with a checkpoint of the step it
was on.

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

Ctrl-C (SIGINT) is handled the same way, without the marker (a person stopped the run, no scheduler
should requeue it), and exits 130 as an interrupted program does. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from vltrain.errors import UserError

EXIT_CODE = 75
INTERRUPTED_EXIT_CODE = 130
MARKER = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preempted(UserError):
    """The run stopped on a signal after saving a checkpoint: run the same command to resume."""

    label = "stopped"

    def __init__(self, message: str, exit_code: int = EXIT_CODE):
        super().__init__(message)
        self.exit_code = exit_code


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
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: do not wait for the step to end

    @property
    def interrupted(self) -> bool:
        """The signal was Ctrl-C (SIGINT), not a scheduler's warning."""
        return self.signum == signal.SIGINT

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
