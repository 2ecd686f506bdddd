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


def test_errors_are_appended_to_bad_samples_jsonl(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.5)
    log.record(batch(4, [("a", "empty file (0 bytes)")]))
    log.record(batch(4))
    log.record(batch(4, [("b", "image file not found: ü.png")]))
    lines = [json.loads(x) for x in (tmp_path / "bad_samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert lines == [{"key": "a", "reason": "empty file (0 bytes)"}, {"key": "b", "reason": "image file not found: ü.png"}]
    assert (log.num_bad, log.num_seen) == (2, 14)


def test_one_early_bad_sample_does_not_stop_the_run(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.01, min_seen=100)
    log.record(batch(8, [("a", "r")]))
    for _ in range(20):
        log.record(batch(8))
    assert log.num_bad == 1


def test_too_many_bad_samples_stop_with_a_clear_error(tmp_path):
    log = BadSampleLog(tmp_path, max_bad_fraction=0.05, min_seen=100)
    with pytest.raises(DataError, match=r"failed to load \(listed in .*bad_samples.jsonl\), more than data.max_bad_fraction=0.05. Last: k: gone"):
        for _ in range(20):
            log.record(batch(8, [("k", "gone")]))
    assert log.num_seen >= 100


def test_state_round_trips_and_no_run_dir_writes_nothing(tmp_path):
    log = BadSampleLog(None, max_bad_fraction=1.0)
    log.record(batch(3, [("a", "r")]))
    other = BadSampleLog(None, max_bad_fraction=1.0)
    other.load_state_dict(log.state_dict())
    assert (other.num_bad, other.num_seen) == (1, 4)
    assert not list(tmp_path.iterdir())
