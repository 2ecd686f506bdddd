"""Two "nodes" on this machine: torchrun's c10d rendezvous joins two single-process agents.

Multi-node training differs from one node only in the launch line: two ``torchrun --nnodes 2
--nproc-per-node 1`` agents that meet at a rendezvous must train to the loss curve of one
``torchrun --nproc-per-node 2``. Both agents bind to 127.0.0.1 (``--local-addr``) so that the
workers' master address is the loopback and not this host's name.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from kits import runkit

from vltrain.train.metrics import read_jsonl

STEPS = 10
EXTRA = dict(data__num_workers=0, checkpoint__every=0, train__log_every=1, train__max_steps=STEPS)


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.timeout(240)
def test_two_nodes_train_like_one_node_with_two_processes(tmp_path_factory, tmp_path):
    shapes = runkit.session_shapes(tmp_path_factory)
    one_node = tmp_path / "one-node"
    runkit.ok(runkit.train(shapes, one_node, nproc=2, timeout=100, **EXTRA))

    two_nodes = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{runkit.free_port()}"
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
              "--rdzv-id", uuid.uuid4().hex[:8], "--local-addr", "127.0.0.1", "--max-restarts", "0"]
    nodes = [runkit.start(runkit.train_command(shapes, two_nodes, launch, **EXTRA)) for _ in range(2)]
    deadline = time.monotonic() + 120
    try:
        done = [runkit.finish(node, max(1.0, deadline - time.monotonic())) for node in nodes]
    finally:
        for node in nodes:  # one agent timed out: the other must not outlive the test
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    for proc in done:
        runkit.ok(proc)

    expected = _losses(one_node)
    assert len(expected) == STEPS
    assert _losses(two_nodes) == pytest.approx(expected, rel=0, abs=1e-5)
