import json

import pytest
import torch

from vltrain.data.batch import Batch
from vltrain.data.loading.bad_samples import BadSampleLog
from vltrain.errors import DataError


def batch(n, errors=()):
    return Batch(
        ids=torch.arange(n), pixel_values=torch.zeros(n, 3, 2, 2, dtype=torch.uint8),
        has_image=torch.ones(n, dtype=torch.bool), has_text=torch.ones(n, dtype=torch.bool),
        input_ids=torch.zeros(n, 8, dtype=torch.int64), attention_mask=torch.ones(n, 8, dtype=torch.int64),
        errors=list(errors),
    )


def step(log, b, number=1):
    """One step of a world of one: the loader records, the trainer adds the step's counts and judges."""
    log.record(b)
    log.add(*log.take())
    if log.too_many():
        raise log.error(number, log.last)


def test_errors_are_appended_to_bad_samples_jsonl(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.5)
    step(log, batch(4, [("a", "empty file (0 bytes)")]))
    step(log, batch(4))
    step(log, batch(4, [("b", "image file not found: ü.png")]))
    lines = [json.loads(x) for x in (tmp_path / "bad_samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert lines == [{"key": "a", "reason": "empty file (0 bytes)"}, {"key": "b", "reason": "image file not found: ü.png"}]
    assert (log.num_bad, log.num_seen) == (2, 14)


def test_one_early_bad_sample_does_not_stop_the_run(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.01)
    step(log, batch(8, [("a", "r")]))
    for _ in range(20):
        step(log, batch(8))
    assert log.num_bad == 1


@pytest.mark.parametrize("batch_size", [64, 128])
def test_a_rate_under_the_limit_survives_whatever_the_batch_size(tmp_path, batch_size):
    """openclipart: 15 images over the pixel limit in 7,000 (0.2%), two of them in the first 194
    samples at batch 64: a run must not stop on that, at either batch size."""
    log = BadSampleLog(tmp_path, max_bad_fraction=0.01)
    step(log, batch(192, [("big1", "too many pixels"), ("big2", "too many pixels")]))
    later = [300 + 500 * i for i in range(13)]  # sample positions of the other 13
    for start in range(192, 7000, batch_size):
        n = sum(start <= p < start + batch_size for p in later)
        step(log, batch(batch_size - n, [("x", "too many pixels")] * n))
    assert log.num_bad == 15


def test_a_rate_over_the_limit_stops_once_the_evidence_says_so(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.01)
    with pytest.raises(DataError, match=r"failed to load by step 5 \(listed in .*bad_samples.jsonl\): at least .* "
                                        r"with confidence, more than data.max_bad_fraction=0.01. Last: k: gone"):
        for i in range(100):  # 5% bad
            step(log, batch(19, [("k", "gone")]), i + 1)
    assert 100 <= log.num_seen < 2000


def test_all_bad_from_the_start_stops_at_once(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.5)
    step(log, batch(0, [("a", "image file not found: a.jpg")] * 8))
    with pytest.raises(DataError, match="16 of 16 samples failed to load .*: every one of them"):
        step(log, batch(0, [("b", "image file not found: b.jpg")] * 8))


def test_strict_limit_stops_on_the_first_bad_sample(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.0)
    step(log, batch(64))
    with pytest.raises(DataError):
        step(log, batch(63, [("a", "r")]))


def test_state_round_trips_and_no_run_dir_writes_nothing(tmp_path):
    log = BadSampleLog(None, max_bad_fraction=1.0)
    step(log, batch(3, [("a", "r")]))
    other = BadSampleLog(None, max_bad_fraction=1.0)
    other.load_state_dict(log.state_dict())
    assert (other.num_bad, other.num_seen) == (1, 4)
    assert not list(tmp_path.iterdir())

