"""2-rank training on Hub-style parquet files given as a glob, and on a mixture of them with
img2dataset shards (one cut short) given as a list of strings: each resumes exactly."""

import json

import pytest
from kits.parquetkit import hub_parquet
from kits.runkit import EVERY, assert_identical, assert_resumed_exactly, final_state, ok, session_shapes, train

pytest.importorskip("datasets")


@pytest.mark.timeout(400)
def test_two_ranks_train_on_a_parquet_glob_and_resume_exactly(tmp_path_factory, tmp_path):
    from vltrain.data.loading.audit import audit_run

    shapes = session_shapes(tmp_path_factory)
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    pairs = [((shapes / r["image"]).read_bytes() if r.get("image") else None, r["text"]) for r in rows]
    hub_parquet(tmp_path / "hub", pairs, files=4, row_group=4)
    pattern = tmp_path / "hub" / "data" / "train-*.parquet"

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


@pytest.mark.timeout(400)
def test_two_ranks_train_on_a_list_of_shards_and_a_parquet_glob_and_resume_exactly(tmp_path_factory, tmp_path):
    import shutil
    from pathlib import Path

    from vltrain.data.loading.audit import audit_run

    shapes = session_shapes(tmp_path_factory)
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    pairs = [((shapes / r["image"]).read_bytes() if r.get("image") else None, r["text"]) for r in rows]
    hub_parquet(tmp_path / "hub", pairs, files=3, row_group=4)
    shutil.copytree(Path(__file__).parent.parent / "fixtures" / "img2dataset", tmp_path / "shards")
    sources = f"[{tmp_path}/shards/{{00000..00004}}.tar, {tmp_path}/hub/data/train-*.parquet]"
    settings = {"data__train": sources, "data__max_bad_fraction": 0.2, "data__audit": "true"}

    ref = tmp_path / "ref"
    done = ok(train(shapes, ref, **settings))
    assert "13 lost (of the 20 00001.parquet lists)" in done.stderr  # the cut shard, counted
    last = json.loads((ref / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["source/shards/samples"] > 0 and last["source/train/samples"] > 0  # both sources train
    run = tmp_path / "run"
    assert train(shapes, run, fault="kill:at=step:step=6", **settings).returncode != 0
    resumed = ok(train(shapes, run, **settings))
    assert_resumed_exactly(resumed, run, EVERY)
    assert_identical(final_state(ref), final_state(run))
    report = audit_run(run)
    assert report.ok, report.problems
