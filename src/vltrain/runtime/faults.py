"""Fault injection for testing recovery: kill or fail one rank at a chosen step, on purpose.

The promise that a run survives a worker killed at any step, or a crash in the middle of a
checkpoint write, is only worth what its tests show, and those tests need the failure to happen
at a known place inside real worker processes. One environment variable describes it::

    VLTRAIN_FAULT="kill:at=step:step=7:rank=1:once=/tmp/fired"

- action ``kill`` (SIGKILL, no clean-up, as an out-of-memory kill), ``raise`` (a RuntimeError),
  ``nospace`` (an ``OSError`` ENOSPC, as a write to a full disk raises),
  ``preempt`` (SIGTERM to the torchrun agent, or to this process without one, as Slurm does before
  a preemption; the rank then waits, at most 30 s, until the signal has reached it too) or
  ``stall`` (the rank sleeps ``seconds``, as a slow or stuck one; a stop signal, SIGTERM or
  SIGUSR1, ends it early and reaches the run's own handler) or ``overflow`` (with ``at=grad``:
  an inf in this rank's own part of the gradients, as an fp16 gradient that overflowed in one
  shard);
- ``at``: ``step`` (after optimizer step N, before its checkpoint), ``save`` (while step N's
  checkpoint is half written: tensors on disk, not yet committed) or ``grad`` (step N's gradients,
  reduced and not yet unscaled or clipped);
- ``rank``: the global rank that fails (default: every rank);
- ``once``: a marker file; the fault fires only if it does not exist yet and creates it, so a
  group restarted by torchrun does not fail again at the same step;
- ``seconds``: how long ``stall`` sleeps (default 60).

Unset (the normal case) it costs one dictionary lookup per call.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

ENV = "VLTRAIN_FAULT"


ACTIONS = ("kill", "raise", "preempt", "nospace", "stall", "overflow")


class InjectedFault(RuntimeError):
    """The failure asked for by VLTRAIN_FAULT."""


@dataclass(frozen=True)
class Fault:
    action: str
    at: str
    step: int
    rank: int | None = None
    once: str = ""
    seconds: float = 60.0

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        action, *parts = spec.split(":")
        fields: dict[str, str] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"{ENV}={spec!r}: {part!r} must look like key=value")
            fields[key] = value
        unknown = set(fields) - {"at", "step", "rank", "once", "seconds"}
        if (action not in ACTIONS or unknown or "step" not in fields
                or (action == "overflow") != (fields.get("at") == "grad")):
            raise ValueError(f"{ENV}={spec!r}: expected {'|'.join(ACTIONS)}:at=step|save|grad:step=N"
                             "[:rank=R][:once=PATH][:seconds=S]")
        return cls(action, fields.get("at", "step"), int(fields["step"]),
                   int(fields["rank"]) if "rank" in fields else None, fields.get("once", ""),
                   float(fields.get("seconds", 60)))


def _named(at: str, step: int, rank: int) -> Fault | None:
    """The fault VLTRAIN_FAULT names for this point, step and rank (None: none, or fired once already)."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    fault = Fault.parse(spec)
    if fault.at != at or fault.step != step or (fault.rank is not None and fault.rank != rank):
        return None
    if fault.once:
        try:
            os.close(os.open(fault.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
    return fault


def maybe_overflow(params, step: int, rank: int) -> None:
    """Put an inf into the first gradient element this rank holds (its own shard under FSDP2) if
    VLTRAIN_FAULT names ``overflow:at=grad`` for this step and rank."""
    fault = _named("grad", step, rank)
    if fault is None or fault.action != "overflow":
        return
    for p in params:
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad is not None and grad.numel():
            grad.view(-1)[0] = float("inf")
            return


def maybe_fail(at: str, step: int, rank: int) -> None:
    """Fail here if VLTRAIN_FAULT names this point, step and rank."""
    fault = _named(at, step, rank)
    if fault is None:
        return
    spec = os.environ[ENV]
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "preempt":
        _preempt()
        return
    if fault.action == "stall":
        _stall(fault.seconds)
        return
    if fault.action == "nospace":
        raise OSError(errno.ENOSPC, f"No space left on device (injected: {ENV}={spec})")
    raise InjectedFault(f"injected fault on rank {rank} at {at} of step {step} ({ENV}={spec})")


def _preempt() -> None:
    """SIGTERM to the launcher (which forwards it to every worker), then wait for it to arrive here."""
    arrived: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: arrived.append(signum))
    try:
        os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if arrived and callable(previous):
        previous(signal.SIGTERM, None)  # what the run's own handler would have seen


def _stall(seconds: float) -> None:
    """Sleep up to ``seconds``; SIGTERM or SIGUSR1 ends it early, and still reaches the handler that
    was there (the run's preemption watch), as it would have without the stall."""
    arrived: list[int] = []
    previous: dict[int, object] = {}

    def note(signum, frame) -> None:
        arrived.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        previous[sig] = signal.signal(sig, note)
    try:
        deadline = time.monotonic() + seconds
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
