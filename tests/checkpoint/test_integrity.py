"""Checkpoints that prove themselves (:mod:`vltrain.checkpoint.integrity`): a shard cut short or
with a flipped byte is found at resume, said in one line, and the run resumes from the newest
intact checkpoint, ending bit-identical to a run that never met the damage; eval and export do the
same; a damaged checkpoint named by itself is refused in one line."""

from __future__ import annotations

import pytest
from kits.runkit import assert_identical, final_state, ok, session_shapes, train

from vltrain.checkpoint.integrity import MANIFEST, damage, write_manifest


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
