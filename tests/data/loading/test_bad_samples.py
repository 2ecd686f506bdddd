import json
import os
import time

import pytest
import torch

from vltrain.images import Images
from vltrain.data.batch import Batch
from vltrain.data.loading.bad_samples import BadSampleLog
from vltrain.errors import DataError


def batch(n, errors=()):
    return Batch(
        ids=torch.arange(n), images=Images(torch.zeros(n, 3, 2, 2, dtype=torch.uint8)),
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


# ---------------------------------------------------------------------------------------------
# Two ranks: one decision for the run


def rank0_bad_manifest(shapes, tmp_path):
    """The shapes manifest with every image of rank 0's rows missing: without shuffling, 2 ranks of
    4 rows a step read the rows in blocks of 4, rank 0 the even blocks, every epoch alike."""
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        if "image" in row:
            row["image"] = str(tmp_path / "gone" / f"{i}.png") if (i // 4) % 2 == 0 else str(shapes / row["image"])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def step_counts(run, rank):
    """Per step, the (failed, tried) samples of ``rank``, from its audit log."""
    records = [json.loads(line) for line in (run / "audit" / f"rank{rank}.jsonl").read_text().splitlines()]
    return [(r["replaced"], len(r["ids"]) + r["replaced"]) for r in records if r["kind"] == "batch"]


def first_stop(fraction, steps):
    """The first step whose running totals the judge calls too many, or None."""
    log = BadSampleLog(None, fraction)
    for i, (bad, tried) in enumerate(steps):
        log.add(bad, tried)
        if log.too_many():
            return i + 1
    return None


def world_counts(run):
    return [(a[0] + b[0], a[1] + b[1]) for a, b in zip(step_counts(run, 0), step_counts(run, 1))]


def said(stderr, tag=""):
    """The messages of the ``vltrain{tag}: error: ...`` lines (rank 0 has no tag, rank R ``[rank R]``)."""
    head = f"vltrain{tag}: error: "
    return [line[len(head):].strip() for line in stderr.splitlines() if line.startswith(head)]


def launch_ranks(shapes, run, world, timeout=240, **extra):
    """``vltrain train`` as ``world`` processes joined by torchrun's environment variables (gloo on
    127.0.0.1), without torchrun: its agent stops the other ranks as soon as one exits, and a test
    of what each rank decides by itself must see each one's own exit code and message."""
    from kits.forkrun import Forked, rank_env
    from kits.multiproc import free_port
    from kits.runkit import finish, overrides

    argv = ["train", str(shapes / "base.yaml"), *overrides(shapes, run, **extra)]
    port = free_port()
    procs = [Forked(argv, env=rank_env(dict(os.environ, OMP_NUM_THREADS="1"), r, world, port)) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        return [finish(p, max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:  # one rank hung: the others must not outlive the test
            if p.poll() is None:
                p.kill()
                p.communicate()


OVER = dict(data__shuffle="false", data__max_bad_fraction=0.3, data__audit="true", data__num_workers=1,
            train__max_steps=30, checkpoint__every=0)
"""Rank 0 reads every bad image (61% of its samples), rank 1 none: the world's 44% is over 0.3 by
step 7, while rank 0's own count is not yet (it would be by step 10)."""


@pytest.mark.timeout(300)
def test_every_rank_stops_after_the_same_step_with_the_same_message(tmp_path_factory, tmp_path):
    """Both ranks stop after step 7 on the world's counts, each with exit code 1 and one message,
    neither waiting for the other; one process reading the same steps stops there with the same."""
    from kits.runkit import session_shapes

    shapes = session_shapes(tmp_path_factory)
    manifest, run = rank0_bad_manifest(shapes, tmp_path), tmp_path / "two"
    ranks = launch_ranks(shapes, run, 2, data__train=manifest, **OVER)
    assert [r.returncode for r in ranks] == [1, 1], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    world = world_counts(run)
    assert sum(b for b, _ in step_counts(run, 1)) == 0  # every failure is rank 0's
    stop = first_stop(0.3, world)
    assert stop == len(world) == len(step_counts(run, 1))  # both took the same steps, none after the stop
    assert first_stop(0.3, step_counts(run, 0)) is None  # the world's counts decided, not rank 0's
    [first], [second] = said(ranks[0].stderr), said(ranks[1].stderr, "[rank 1]")
    assert first == second and f"samples failed to load by step {stop} (listed in {run}/bad_samples.jsonl)" in first
    assert f"{sum(b for b, _ in world)} of {sum(t for _, t in world)} samples" in first
    assert "Last: " in first and "Check the data with `vltrain data validate`" in first
    for r in ranks:
        assert "stopped at step" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]

    [one] = launch_ranks(shapes, tmp_path / "one", 1, data__train=manifest, **{**OVER, "data__batch_size": 8})
    assert one.returncode == 1, one.stderr[-3000:]
    assert said(one.stderr) == [first.replace(str(run), str(tmp_path / "one"))]


@pytest.mark.timeout(300)
def test_under_torchrun_the_stop_is_one_message_and_no_rank_waits(tmp_path_factory, tmp_path):
    """Under torchrun, whichever rank exits first ends the job: every message said is the same one,
    and no rank is left to fail on a lost peer."""
    from kits.runkit import session_shapes, train

    shapes = session_shapes(tmp_path_factory)
    done = train(shapes, tmp_path / "run", timeout=240, data__train=rank0_bad_manifest(shapes, tmp_path), torchrun=True,
                 **OVER)
    assert done.returncode == 1, done.stderr[-3000:]
    messages = said(done.stderr) + said(done.stderr, "[rank 1]")
    assert messages and len(set(messages)) == 1 and "failed to load by step 7" in messages[0], done.stderr[-3000:]
    assert "stopped at step" not in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_one_rank_over_the_fraction_does_not_stop_a_world_under_it(tmp_path_factory, tmp_path):
    """The same data at 0.5: rank 0's own 61% would stop it by step 21, the world's 44% never does.
    The run ends, and its count of replaced samples is the world's."""
    from kits.runkit import session_shapes, train

    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    done = train(shapes, run, timeout=240, data__train=rank0_bad_manifest(shapes, tmp_path),
                 **{**OVER, "data__max_bad_fraction": 0.5})
    assert done.returncode == 0, done.stderr[-3000:]
    world = world_counts(run)
    assert len(world) == 30 and first_stop(0.5, world) is None
    assert first_stop(0.5, step_counts(run, 0)) <= 30
    replaced = sum(b for b, _ in world)
    assert replaced == len((run / "bad_samples.jsonl").read_text().splitlines())
    assert f"bad samples: {replaced} replaced" in done.stdout.splitlines()[-1]
