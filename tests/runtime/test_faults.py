"""Fault injection fires exactly where, when and as often as asked."""

import pytest

from vltrain.runtime.faults import ENV, Fault, InjectedFault, maybe_fail


def test_parse():
    f = Fault.parse("kill:at=save:step=7:rank=1:once=/tmp/x")
    assert (f.action, f.at, f.step, f.rank, f.once) == ("kill", "save", 7, 1, "/tmp/x")
    assert Fault.parse("raise:step=3") == Fault("raise", "step", 3)
    for bad in ("explode:step=1", "raise:at=step", "raise:step=1:colour=red", "raise:step"):
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
