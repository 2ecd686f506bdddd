"""``python -m vltrain ARGS`` as a process forked from one that has already imported vltrain.

Each ``vltrain train`` of the suite spends about 5 of its 7.6 CPU-seconds importing torch, its
checkpointing, dynamo and tensorboard before its first step, and the suite starts about two hundred
of them. Here a :mod:`multiprocessing` fork server imports those modules once per test worker, and
each command is a fresh process forked from it: its own pid, process group, working folder,
environment, standard streams and exit status, as a launched one has. It runs vltrain's own entry
point (:func:`vltrain.cli.main.run`), with ``sys.argv`` as ``python -m vltrain`` sets it.

What it is not: a test of how the process starts. Tests of the launch itself (the installed
``vltrain`` script, torchrun's agent and its workers, signals to a launcher, environment read at
import) start real processes (:mod:`kits.runkit`'s torchrun path, ``subprocess``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing import connection
from pathlib import Path

PRELOAD = [
    "vltrain.cli.main", "vltrain.config.job", "vltrain.train.trainer", "vltrain.eval.evaluator",
    "torch._dynamo", "torch.utils.tensorboard", "torch.distributed.checkpoint", "numpy.ma",
]
"""What ``vltrain train`` imports, measured with ``python -X importtime``: the heavy part of its start."""


def context():
    """The fork server context, with vltrain imported in the server before its first fork."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _main(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The forked process: a session of its own, then ``python -m vltrain ARGV`` in ``cwd``."""
    os.setsid()
    multiprocessing.set_start_method(None, force=True)  # its loader workers by fork, as in a plain process
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.argv = [str(Path(sys.modules["vltrain"].__file__).parent / "__main__.py"), *argv]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    from vltrain.cli.main import run

    try:
        run()
    finally:  # what the interpreter's shutdown runs; a fork server's child leaves by os._exit
        atexit._run_exitfuncs()


class Forked:
    """A started command, with the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, argv: list[str], *, cwd: Path | str | None = None, env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", "vltrain", *argv]
        self._dir = tempfile.mkdtemp(prefix="vltrain-forked-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # also when the output is never read
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        self._proc = context().Process(target=_main, args=(list(argv), str(cwd or os.getcwd()),
                                                              dict(os.environ if env is None else env),
                                                              self._out, self._err))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL to the command's process group: it and its loader workers."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = (Path(p).read_text(errors="backslashreplace") for p in (self._out, self._err))
        self._proc.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        return out, err


def rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """``env`` with what a launcher gives rank ``rank`` of ``nproc`` on this machine (the store on 127.0.0.1:``port``)."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


class World:
    """``vltrain ARGV`` on ``nproc`` ranks, each a :class:`Forked` process, joined through the
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``: rank 0 holds the store) as
    a launcher such as Slurm's ``srun`` starts them, with no torchrun agent. As torchrun does, when a
    rank fails the others get SIGTERM (SIGKILL 10 s later), and the exit status is 0 when every rank
    returned 0, else 1. The outputs are each rank's in turn."""

    GRACE_S = 10.0

    def __init__(self, argv: list[str], nproc: int, port: int, *, cwd: Path | str | None = None,
                 env: dict[str, str] | None = None):
        base = dict(os.environ if env is None else env)
        self.ranks = [Forked(argv, cwd=cwd, env=rank_env(base, r, nproc, port)) for r in range(nproc)]
        self.args = self.ranks[0].args
        self.pid = self.ranks[0].pid
        self.returncode: int | None = None

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        stopping_since = None
        while self.poll() is None:
            codes = [r.poll() for r in self.ranks]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if stopping_since is None and any(codes):
                stopping_since = now
                for r in self.ranks:
                    r.send_signal(signal.SIGTERM)
            elif stopping_since is not None and now - stopping_since > self.GRACE_S:
                self.kill()
            left = [r._proc.sentinel for r in self.ranks if r.poll() is None]
            connection.wait(left, timeout=0.5 if deadline is None else max(0.0, min(0.5, deadline - now)))

    def poll(self) -> int | None:
        codes = [r.poll() for r in self.ranks]
        if self.returncode is None and all(c is not None for c in codes):
            self.returncode = 0 if not any(codes) else 1
        return self.returncode

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._wait(timeout)
        outs = [r.communicate() for r in self.ranks]
        return "".join(o for o, _ in outs), "".join(e for _, e in outs)


def run(argv: list[str], *, timeout: float = 300, cwd: Path | str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m vltrain ARGV`` to its end, as :func:`subprocess.run` with ``capture_output`` and
    ``text``; past ``timeout`` its process group is killed and :class:`subprocess.TimeoutExpired` raised."""
    proc = Forked([str(a) for a in argv], cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
