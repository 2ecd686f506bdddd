"""Fault injection fires exactly where, when and as often as asked."""

import pytest

import torch

from vltrain.runtime.faults import ENV, Fault, InjectedFault, maybe_fail, maybe_overflow


def test_parse():
    f = Fault.parse("kill:at=save:step=7:rank=1:once=/tmp/x")
    assert (f.action, f.at, f.step, f.rank, f.once) == ("kill", "save", 7, 1, "/tmp/x")
    assert Fault.parse("raise:step=3") == Fault("raise", "step", 3)
    assert Fault.parse("overflow:at=grad:step=4:rank=0") == Fault("overflow", "grad", 4, 0)
    for bad in ("explode:step=1", "raise:at=step", "raise:step=1:colour=red", "raise:step",
                "overflow:step=4", "raise:at=grad:step=4"):
        with pytest.raises(ValueError, match=ENV):
            Fault.parse(bad)


def test_fires_only_at_its_point_step_and_rank_once(tmp_path, monkeypatch):
    maybe_fail("step", 3, 1)  # unset: nothing
    marker = tmp_path / "fired"
    monkeypatch.setenv(ENV, f"raise:at=step:step=3:rank=1:once={marker}")
    maybe_fail("step", 2, 1)
    maybe_fail("step", 3, 0)
    maybe_fail("save", 3, 1)
    with pytest.raises(InjectedFault, match="rank 1"):
        maybe_fail("step", 3, 1)
    assert marker.exists()
    maybe_fail("step", 3, 1)  # a restarted group does not fail again


def test_an_overflow_puts_one_inf_in_this_ranks_first_gradient_at_its_step(monkeypatch):
    params = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    for p in params:
        p.grad = torch.zeros_like(p)
    monkeypatch.setenv(ENV, "overflow:at=grad:step=4:rank=0")
    maybe_overflow(params, 3, 0)
    maybe_overflow(params, 4, 1)
    maybe_fail("step", 4, 0)  # another point: nothing
    assert all(torch.isfinite(p.grad).all() for p in params)
    maybe_overflow(params, 4, 0)
    assert params[1].grad.isinf().tolist() == [True, False, False] and torch.isfinite(params[2].grad).all()


def test_a_stall_sleeps_until_a_stop_signal_which_still_reaches_the_runs_handler(monkeypatch):
    import os
    import signal
    import threading
    import time

    seen: list[int] = []

    def handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        monkeypatch.setenv(ENV, "stall:at=step:step=2:seconds=0.3")
        start = time.monotonic()
        maybe_fail("step", 2, 0)  # no signal: the whole stall
        assert 0.3 <= time.monotonic() - start < 5
        monkeypatch.setenv(ENV, "stall:at=step:step=2:seconds=60")
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        start = time.monotonic()
        maybe_fail("step", 2, 0)
        assert time.monotonic() - start < 5 and seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
