"""Run a function on N real gloo processes (forked from a fork server) and collect what each returns.

Each rank returns a picklable value (tensors included); a rank that raises makes the whole run fail
with its traceback, and a run that exceeds ``timeout`` is killed, so nothing can hang the suite.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
from kits import forkrun


PORTS = range(20000, 32000)
"""Ports tests hand out: below Linux's ephemeral range (32768-60999), where the kernel places the
sockets a run opens itself (gloo's pairs, clients), so none of those can take a port before its
launcher binds it."""
_next = {"at": None}


def free_port() -> int:
    """A port to give a launcher (torchrun's store, a gloo init, a server). Each pytest-xdist worker
    has its own block of ``PORTS`` and takes its ports in turn, from a random start (two suites at
    once), skipping any that something already holds: no two tests running side by side are handed
    the same port, which the kernel's ``bind(0)`` cannot promise once the probe socket is closed."""
    import random

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    block = len(PORTS) // 8
    first = PORTS.start + (worker % 8) * block
    if _next["at"] is None:
        _next["at"] = random.randrange(block)
    for _ in range(block):
        port = first + _next["at"]
        _next["at"] = (_next["at"] + 1) % block
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}-{first + block - 1}")


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        )
        result = fn(rank, world, *args)
        dist.barrier()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, args: tuple = (), world: int = 2, timeout: float = 60.0, tmp_dir: str | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results in rank order."""
    if tmp_dir is None:  # each rank's result file, removed with the directory once read
        import tempfile

        with tempfile.TemporaryDirectory(prefix="vltrain-mp-") as scratch:
            return run_world(fn, args, world, timeout, scratch)
    out_dir = tmp_dir
    ctx = forkrun.context()  # a fresh process per rank, without importing torch and vltrain again
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
    results = []
    for r in range(world):
        data = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
        if not data["ok"]:
            raise RuntimeError(f"rank {r} failed:\n{data['error']}")
        results.append(data["result"])
    return results
