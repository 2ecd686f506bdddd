"""Elastic runs: a node lost, hung or added mid-run, and the run goes on by itself on the same curve.

Two torchrun agents on this machine are two nodes (``--nnodes 1:2``, c10d rendezvous on 127.0.0.1,
one worker each), training one global batch (``data.global_batch_size``), so a step is the same on
one node or two. A node is lost (SIGKILL to its agent and worker), hangs (SIGSTOP to both) or
joins late; the agents re-form the group, the workers resume from the latest checkpoint, and the
run ends within 1e-5 of a run whose world never changed (1 process).

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13's agents share their rendezvous store with the
workers, and an agent that stays rank 0 across a re-rendezvous never publishes the new round's
master address, so a node joining waits for it until the timeout (pytorch/pytorch#135712 is the
same sharing failing restarts). docs/distributed.md#elastic-runs says so.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

import psutil
import pytest
from kits import runkit

from vltrain.train.metrics import read_jsonl

STEPS = 40
"""Short: 1 and 2 ranks of one global batch agree to float rounding, and over hundreds of steps
of this tiny model that rounding grows past 1e-5 (a plain 1-rank and 2-rank run: 1e-7 by step
60, 1e-2 by step 200)."""
TOL = 1e-5
SETTINGS = dict(data__num_workers=0, data__global_batch_size=16, data__batch_size=16, train__max_steps=STEPS,
                train__log_every=1, checkpoint__every=5, checkpoint__keep=0, train__timeout_s=60)
STALL = "stall:at=step:step={step}:seconds=120"
"""The worker of one node sleeps after a step, so that the node is lost, hangs or is joined while
the run is at that step. The node lost or hung is the second one: the first hosts the rendezvous
store (--rdzv-endpoint), which torchrun cannot lose."""


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def steps_logged(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def unchanged(tmp_path_factory) -> dict[int, float]:
    """The loss curve of the run whose world never changed: one process."""
    shapes = runkit.session_shapes(tmp_path_factory)
    run = tmp_path_factory.mktemp("elastic") / "unchanged"
    runkit.ok(runkit.train(shapes, run, nproc=1, timeout=200, **SETTINGS))
    curve = losses(run)
    assert len(curve) == STEPS
    return curve


class Nodes:
    """torchrun agents on one rendezvous, each a "node" with one worker."""

    def __init__(self, tmp_path_factory, run_dir: Path, last_call: int, **extra):
        shapes = runkit.session_shapes(tmp_path_factory)
        self.port = runkit.free_port()
        endpoint = f"127.0.0.1:{self.port}"
        self.command = runkit.train_command(shapes, run_dir, [
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", uuid.uuid4().hex[:8], "--local-addr", "127.0.0.1", "--max-restarts", "3",
            "--rdzv-conf", f"last_call_timeout={last_call},keep_alive_interval=1,keep_alive_max_attempt=3",
        ], **{**SETTINGS, **extra})
        self.run_dir, self.agents = run_dir, []

    def start(self, fault: str = ""):
        """Another node; ``fault``: its VLTRAIN_FAULT."""
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        try:
            agent = runkit.start(self.command, fault)
        finally:
            del os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
        self.agents.append(agent)
        if len(self.agents) == 1:  # the first hosts the rendezvous store: up before any other starts
            deadline = time.monotonic() + 60
            while not listening(self.port):
                assert agent.poll() is None and time.monotonic() < deadline, "the first agent did not start"
                time.sleep(0.05)
        return agent

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while steps_logged(self.run_dir) < step:
            assert time.monotonic() < deadline, f"the run did not reach step {step} within {timeout} s"
            assert all(a.poll() is None for a in self.agents), "an agent ended early"
            time.sleep(0.05)

    @staticmethod
    def signal_node(agent, sig: int) -> None:
        """``sig`` to the agent and its worker: the whole node."""
        for p in [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]:
            p.send_signal(sig)

    def second_node_fails(self, sig: int):
        """Two nodes; the second stalls after step 22 and gets ``sig`` there (its agent and worker)
        while the first waits for it. The first node's finished launcher."""
        try:
            survivor = self.start()
            failing = self.start(STALL.format(step=22))
            self.wait_for_step(22)
            self.signal_node(failing, sig)
            return runkit.ok(runkit.finish(survivor, 200))
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        """Every agent and worker still there (a stopped one too), so that none holds a pipe open."""
        for agent in self.agents:
            if agent.poll() is None:
                procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
                for p in procs:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
            agent.communicate()


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def resumed_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("resumed from")]


def assert_same_curve(run_dir: Path, unchanged: dict[int, float]) -> None:
    curve = losses(run_dir)
    assert sorted(curve) == sorted(unchanged)
    worst = max(abs(curve[s] - unchanged[s]) / abs(unchanged[s]) for s in unchanged)
    assert worst < TOL, worst


@pytest.mark.timeout(300)
def test_a_node_lost_mid_run_and_the_other_goes_on_alone(tmp_path_factory, tmp_path, unchanged):
    # checkpoints every 5 steps and every 0.6 s: the resume is from the newer of the two
    nodes = Nodes(tmp_path_factory, tmp_path / "run", 5, checkpoint__every_minutes=0.01)
    done = nodes.second_node_fails(signal.SIGKILL)
    assert "global batch 16 = 2 rank(s) x 1 micro-batch(es) x 8 rows" in done.stderr
    assert "stopped at step 22: lost its peers" in done.stderr, done.stderr[-3000:]
    resumed = resumed_lines(done)
    assert len(resumed) == 1, done.stderr[-3000:]
    assert "on 1 rank(s) (same global batches; model and optimizer resharded from 2)" in resumed[0]
    assert " s since step " in resumed[0] and "trained again" in resumed[0]
    assert_same_curve(tmp_path / "run", unchanged)


@pytest.mark.timeout(300)
def test_a_node_that_joins_mid_run_is_trained_on(tmp_path_factory, tmp_path, unchanged):
    # the first node alone stalls after step 10 until its agent, seeing the second node, stops it
    nodes = Nodes(tmp_path_factory, tmp_path / "run", 1)
    try:
        first = nodes.start(STALL.format(step=10))
        nodes.wait_for_step(10)
        second = nodes.start()
        done = runkit.ok(runkit.finish(first, 200))
        runkit.ok(runkit.finish(second, 60))
    finally:
        nodes.kill_all()
    assert "global batch 16 = 1 rank(s) x 1 micro-batch(es) x 16 rows" in done.stderr
    # the agent stopped the stalled worker; the signal reached it after step 10, it stopped at the next
    assert "stopped: SIGTERM at step 11" in done.stderr, done.stderr[-3000:]
    resumed = resumed_lines(done)
    assert len(resumed) == 1, done.stderr[-3000:]
    assert "at step 11 on 2 rank(s) (same global batches; model and optimizer resharded from 1)" in resumed[0]
    assert "0 step(s) trained again" in resumed[0]
    assert_same_curve(tmp_path / "run", unchanged)


@pytest.mark.timeout(300)
def test_a_hung_node_is_detected_within_the_timeout_and_the_run_goes_on(tmp_path_factory, tmp_path, unchanged):
    timeout_s = 8
    nodes = Nodes(tmp_path_factory, tmp_path / "run", 5, train__timeout_s=timeout_s)
    done = nodes.second_node_fails(signal.SIGSTOP)
    said = [line for line in done.stderr.splitlines() if "did not answer within train.timeout_s" in line]
    assert len(said) == 1 and said[0].startswith("vltrain: rank 0 stopped at step 22"), done.stderr[-3000:]
    assert f"Timed out waiting {timeout_s * 1000}ms" in said[0]  # gloo's timeout is train.timeout_s
    assert "Traceback" not in done.stderr
    resumed = resumed_lines(done)
    assert len(resumed) == 1 and "at step 20 on 1 rank(s)" in resumed[0]
    assert_same_curve(tmp_path / "run", unchanged)
