"""Checkpoints that prove themselves (:mod:`vltrain.checkpoint.integrity`): a shard cut short or
with a flipped byte is found at resume, said in one line, and the run resumes from the newest
intact checkpoint, ending bit-identical to a run that never met the damage; eval and export do the
same; a damaged checkpoint named by itself is refused in one line."""

from __future__ import annotations

import re

import pytest
import torch
from kits.runkit import assert_identical, final_state, ok, session_shapes, train

from vltrain.checkpoint.integrity import MANIFEST, damage, write_manifest
from vltrain.checkpoint.manager import Checkpointer, ModelState
from vltrain.checkpoint.paths import latest_checkpoint
from vltrain.config.job import CheckpointConfig
from vltrain.errors import UserError


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_finds_a_cut_a_flip_and_a_missing_file(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("data:\n  upscale: true\n")
    assert damage(tmp_path) is None  # no manifest: a checkpoint older than manifests is taken as it is
    write_manifest(tmp_path)
    assert (tmp_path / MANIFEST).is_file() and damage(tmp_path) is None
    (tmp_path / "config.yaml").write_text("data:\n  upscale: false\n")  # the config copy is the user's to edit
    assert damage(tmp_path) is None
    flip(tmp_path / "a.bin")
    assert damage(tmp_path) == "a.bin is not as it was saved (its CRC-32 differs)"
    flip(tmp_path / "a.bin")
    truncate(tmp_path / "a.bin")
    assert damage(tmp_path) == "a.bin is 10,140 bytes, 10,240 when it was saved"
    (tmp_path / "sub" / "b.json").unlink()
    assert damage(tmp_path) in ("sub/b.json is missing", "a.bin is 10,140 bytes, 10,240 when it was saved")


def fake_checkpoint(folder, step: int):
    """A complete step-N folder (the files that make it one) with its manifest."""
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / "state.json").write_text("{}")
    (path / ".metadata").write_bytes(bytes(range(256)) * 4)
    write_manifest(path)
    return path


def test_the_newest_intact_checkpoint_is_taken_and_the_damaged_ones_named(tmp_path, caplog):
    two, four, six = (fake_checkpoint(tmp_path, s) for s in (2, 4, 6))
    (tmp_path / "latest").write_text("step-6\n")
    flip(six / ".metadata")
    truncate(four / ".metadata")
    assert latest_checkpoint(tmp_path) == two
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"checkpoint {six} is damaged (.metadata is not as it was saved")
    assert f"checkpoint {four} is damaged (.metadata is 924 bytes, 1,024 when it was saved)" in said[0]
    assert said[0].endswith(f"using {two}, the newest intact checkpoint")
    (two / "state.json").write_text("{} ")
    with pytest.raises(UserError, match=r"step-2 is damaged \(state.json is 3 bytes, 2 when it was saved\); no "
                                        r"intact checkpoint is left in .*: restore one from a copy"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_older_than_manifests_is_checked_against_its_index(tmp_path, caplog):
    """No files.json (written before it existed): DCP's index says where each file's bytes end, so a
    file cut short is still found and passed over; a flipped byte cannot be, and is taken as it is."""
    ckpt = Checkpointer(CheckpointConfig(), tmp_path, {"model": ModelState(torch.nn.Linear(64, 64))})
    ckpt.save(1)
    ckpt.save(2)
    folder = tmp_path / "checkpoints"
    for step in (1, 2):
        (folder / f"step-{step}" / MANIFEST).unlink()
    assert damage(folder / "step-2") is None and latest_checkpoint(folder) == folder / "step-2"
    flip(folder / "step-2" / "__0_0.distcp")
    assert damage(folder / "step-2") is None
    truncate(folder / "step-2" / "__0_0.distcp")
    assert latest_checkpoint(folder) == folder / "step-1"
    assert re.search(r"step-2 is damaged \(__0_0.distcp is [\d,]+ bytes, its index reaches byte [\d,]+\): "
                     r"using .*step-1, the newest intact checkpoint", caplog.records[-1].getMessage())


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("nproc", "parallelism", "harm", "shard"), [
    (1, "ddp", truncate, "__0_0.distcp"),
    (1, "ddp", flip, "__0_0.distcp"),
    (2, "ddp", flip, "__1_0.distcp"),
    (2, "fsdp", truncate, "__1_0.distcp"),
])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(nproc, parallelism, harm, shard,
                                                                         tmp_path_factory, tmp_path, cli):
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"
    knobs = {"train__parallelism": parallelism, "train__max_steps": 6, "checkpoint__every": 2}
    ok(train(shapes, run, nproc=nproc, **knobs))
    latest = run / "checkpoints" / "step-6"
    uninterrupted = final_state(run)
    harm(latest / shard)
    # eval and export take the newest intact checkpoint, saying which
    proc = cli("export", run, "--out", tmp_path / "export")
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {latest} is damaged" in proc.stderr and "step-4, the newest intact checkpoint" in proc.stderr
    # a damaged checkpoint named by itself is refused in one line
    proc = cli("eval", latest)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"checkpoint {latest} is damaged" in proc.stderr and "name an intact one" in proc.stderr
    # the resume: from step 4, steps 5 and 6 again, the same weights and optimizer state as before
    proc = ok(train(shapes, run, nproc=nproc, **knobs))
    assert f"checkpoint {latest} is damaged" in proc.stderr and "Traceback" not in proc.stderr
    assert f"resumed from {run / 'checkpoints' / 'step-4'} at step 4 (exactly)" in proc.stderr, proc.stderr
    assert damage(latest) is None  # step 6 written anew
    assert_identical(final_state(run), uninterrupted)
