"""How many CPUs this process may use (standard library only: the data tools read it without torch)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (``taskset``, Slurm's ``--cpus-per-task``, a
    container's cpuset), which ``os.cpu_count()`` ignores (it counts the machine's); the machine's
    count where the system keeps no affinity."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1
