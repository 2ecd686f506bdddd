"""The alignment audit: clean runs pass, duplicates, losses and inexact resumes are caught."""

from __future__ import annotations

import json

import pytest
from kits.sampler_fixtures import TableDataset, collate, shapes_lengths, table

from vltrain.data.loading.audit import AuditLog, audit_run
from vltrain.data.loading.loader import TrainLoader
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule

N = 21


def record_run(run_dir, steps, world=2, **kw):
    t = table(shapes_lengths(N))
    for rank in range(world):
        s = DistributedBatchSampler(t, Schedule(batch_size=4, seed=0, **kw), rank=rank, world_size=world)
        loader = TrainLoader(TableDataset(t), s, collate=collate, audit=AuditLog(run_dir, rank, world))
        for _ in range(steps):
            next(loader)
        loader.audit.close()


def lines(run_dir, rank):
    return [json.loads(x) for x in (run_dir / "audit" / f"rank{rank}.jsonl").read_text().splitlines()]


def rewrite(run_dir, rank, rows):
    (run_dir / "audit" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("remainder,epochs", [("pad", 3), ("drop", 4)])
def test_clean_run_over_epochs_passes(tmp_path, remainder, epochs):
    # 21 samples, 2 ranks x 4 rows: 3 steps per epoch when padding, 2 when dropping; 7 steps
    # end inside the last epoch.
    record_run(tmp_path, steps=7, remainder=remainder)
    report = audit_run(tmp_path)
    assert report.ok, report.problems
    assert report.epochs == epochs and report.complete_epochs == epochs - 1


def test_cli_reports_ok_and_failure(tmp_path, cli):
    record_run(tmp_path, steps=3)
    ok = cli("data", "audit", tmp_path)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    rows = lines(tmp_path, 1)
    rows[1]["ids"][0] = lines(tmp_path, 0)[1]["ids"][0]  # rank 1 consumes a sample rank 0 had
    rewrite(tmp_path, 1, rows)
    bad = cli("data", "audit", tmp_path)
    assert bad.returncode == 1 and "more than once" in bad.stdout, bad.stdout + bad.stderr


def test_missing_records_is_a_clear_error(tmp_path, cli):
    res = cli("data", "audit", tmp_path)
    assert res.returncode != 0 and "data.audit=true" in res.stderr + res.stdout
    assert "Traceback" not in res.stderr


def test_sample_lost_from_a_batch_is_caught(tmp_path):
    record_run(tmp_path, steps=3)
    rows = lines(tmp_path, 0)
    rows[2]["ids"] = rows[2]["ids"][1:]
    rewrite(tmp_path, 0, rows)
    problems = audit_run(tmp_path).problems
    assert any("never consumed" in p for p in problems), problems


def test_exact_resume_rerecords_pass_and_inexact_ones_fail(tmp_path):
    record_run(tmp_path, steps=3)
    rows = lines(tmp_path, 0)
    rewrite(tmp_path, 0, rows + rows[2:])  # a restart from step 1 that replayed the same batches
    assert audit_run(tmp_path).ok
    changed = dict(rows[-1], ids=list(reversed(rows[-1]["ids"])))
    rewrite(tmp_path, 0, rows + [changed])
    assert any("resume was not exact" in p for p in audit_run(tmp_path).problems)


def test_ranks_with_different_schedules_are_caught(tmp_path):
    record_run(tmp_path, steps=3)
    rows = lines(tmp_path, 1)
    rows[0]["batches"] += 1
    rewrite(tmp_path, 1, rows)
    assert any("different batch counts" in p for p in audit_run(tmp_path).problems)
