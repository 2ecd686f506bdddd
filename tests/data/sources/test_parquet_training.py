"""2-rank training on Hub-style parquet files given as a brace pattern: it resumes exactly."""

import json

import pytest
from parquetkit import hub_parquet
from runkit import EVERY, assert_identical, assert_resumed_exactly, final_state, ok, session_shapes, train

pytest.importorskip("datasets")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_train_on_parquet_and_resume_exactly(tmp_path_factory, tmp_path):
    from vltrain.data.loading.audit import audit_run

    shapes = session_shapes(tmp_path_factory)
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    pairs = [((shapes / r["image"]).read_bytes() if r.get("image") else None, r["text"]) for r in rows]
    hub_parquet(tmp_path / "hub", pairs, files=4, row_group=4)
    pattern = tmp_path / "hub" / "data" / "train-{00000..00003}-of-00004.parquet"

    ref = tmp_path / "ref"
    ok(train(shapes, ref, data__train=pattern, data__audit="true"))
    run = tmp_path / "run"
    stopped = train(shapes, run, data__train=pattern, data__audit="true", fault="kill:at=step:step=6")
    assert stopped.returncode != 0
    resumed = ok(train(shapes, run, data__train=pattern, data__audit="true"))
    assert_resumed_exactly(resumed, run, EVERY)
    assert_identical(final_state(ref), final_state(run))
    report = audit_run(run)
    assert report.ok, report.problems
    assert report.samples > 0
