"""Damaged tar shards: what they still hold is kept, what was lost is counted, and nothing stops
a run by surprise. The img2dataset fixtures are real img2dataset output (``make_img2dataset.py``):
five shards of 20 URLs, two of which answered 404, and ``00001.tar`` cut inside its 8th sample's
image as a dying worker leaves it."""

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from vltrain.data.sources.shard_scan import scan_shard

FIXTURES = Path(__file__).parent.parent / "fixtures" / "img2dataset"
PATTERN = "{00000..00004}.tar"


@pytest.fixture
def shards(tmp_path):
    """A copy of the img2dataset output (its index is written beside it)."""
    out = tmp_path / "shards"
    shutil.copytree(FIXTURES, out)
    return out


def _tar(path: Path, samples: int) -> list[tarfile.TarInfo]:
    """A shard as img2dataset orders members (jpg, json, txt); its members."""
    with tarfile.open(path, "w") as tar:
        for k in range(samples):
            for ext, data in (("jpg", b"\xff\xd8" + bytes(700 + k)), ("json", json.dumps({"key": f"{k:04d}"}).encode()),
                              ("txt", f"caption {k}".encode())):
                info = tarfile.TarInfo(f"{k:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:
        return tar.getmembers()


def _kept(scan) -> list[str]:
    return [s[0] for s in scan.samples]


def test_img2dataset_shard_cut_mid_image_keeps_its_samples_and_counts_the_rest(shards):
    scan = scan_shard(shards / "00001.tar", samples=True)
    assert len(scan.samples) == 7
    [(where, why, level, lost)] = scan.problems
    assert level == "error" and lost == {"offset": lost["offset"], "kept": 7, "lost": 13, "exact": True}
    assert why.startswith("damaged tar: cut short at byte 76737, inside ")
    assert why.endswith("7 samples kept, 13 lost (of the 20 00001.parquet lists)")
    for name in ("00000", "00002", "00003", "00004"):  # whole shards read as before
        assert scan_shard(shards / f"{name}.tar").problems == []


def test_without_img2dataset_listing_the_count_is_a_lower_bound(shards):
    (shards / "00001.parquet").unlink()
    [(_, why, _, lost)] = scan_shard(shards / "00001.tar").problems
    assert (lost["kept"], lost["lost"], lost["exact"]) == (7, 1, False)
    assert "at least 1 lost and the rest of the file" in why


@pytest.mark.parametrize("where", ["header", "data", "boundary"])
def test_a_tar_cut_anywhere_keeps_every_whole_sample_before_the_cut(tmp_path, where):
    path = tmp_path / "s.tar"
    members = _tar(path, 6)
    txt = members[3 * 3 + 2]  # sample 3's caption, its last member
    cut = {"header": txt.offset + 100, "data": txt.offset_data + 3, "boundary": txt.offset}[where]
    path.write_bytes(path.read_bytes()[:cut])
    scan = scan_shard(path, samples=True)
    assert _kept(scan) == ["0000", "0001", "0002"]  # sample 3 lost its caption: dropped, not image-only
    [(_, why, _, lost)] = scan.problems
    assert why.startswith("damaged tar: cut short") and (lost["kept"], lost["lost"]) == (3, 1)


def test_a_corrupt_header_in_the_middle_loses_only_its_sample(tmp_path):
    path = tmp_path / "s.tar"
    members = _tar(path, 6)
    data = bytearray(path.read_bytes())
    bad = members[2 * 3 + 1].offset  # sample 2's json header
    data[bad : bad + 100] = b"\x07" * 100
    path.write_bytes(bytes(data))
    scan = scan_shard(path, samples=True)
    assert _kept(scan) == ["0000", "0001", "0003", "0004", "0005"]
    [(where, why, _, lost)] = scan.problems
    assert where == f"byte {bad}" and why.startswith(f"damaged tar: unreadable header at byte {bad}")
    assert (lost["kept"], lost["lost"], lost["exact"]) == (5, 1, False)


def test_a_file_that_is_no_tar_is_still_refused(tmp_path):
    from vltrain.errors import DataError

    (tmp_path / "s.tar").write_bytes(b"\x1f\x8b" + bytes(3000))
    with pytest.raises(DataError, match="not a readable tar file"):
        scan_shard(tmp_path / "s.tar")


def test_an_empty_shard_is_a_damaged_one(tmp_path):
    (tmp_path / "s.tar").write_bytes(b"")
    [(_, why, _, lost)] = scan_shard(tmp_path / "s.tar").problems
    assert why.startswith("damaged tar: empty file") and lost["kept"] == 0


def test_the_index_records_the_damage_and_on_error_fail_refuses_it(shards):
    from vltrain.data.index.open import open_indexed
    from vltrain.data.sources.manifests import refuse_malformed
    from vltrain.errors import DataError

    source = open_indexed(str(shards / PATTERN), None, 77)
    assert len(source) == 19 + 7 + 19 + 20 + 2
    [damaged] = source.damaged
    assert damaged["where"].startswith("00001.tar:byte ") and damaged["lost"] == 13
    with pytest.raises(DataError, match=r"1 damaged file\(s\) or row group\(s\):\n  00001.tar:byte \d+: damaged tar: "
                                        r"cut short at byte 76737.*\nRepair or download them again, or set "
                                        r"data.on_error: skip"):
        refuse_malformed(source)


def test_validate_reports_the_damaged_shard_and_counts_the_good_rows(shards, capsys):
    from kits.datafiles import run_cli

    code, out, err = run_cli(capsys, "data", "validate", shards / PATTERN)
    assert code == 1 and "Traceback" not in err
    assert f"{shards / PATTERN}: 67 rows (67 image-text" in out
    assert "error: 00001.tar:byte " in out and "7 samples kept, 13 lost (of the 20 00001.parquet lists)" in out


def test_lost_samples_count_against_max_bad_fraction(tmp_path):
    from vltrain.data.loading.bad_samples import BadSampleLog
    from vltrain.errors import DataError

    damaged = [{"where": "00001.tar:byte 73728", "reason": "damaged tar: cut short", "lost": 13, "exact": True}]
    with pytest.raises(DataError, match=r"13 of 80 samples \(16.25%\) are lost in 1 damaged file\(s\), more than "
                                        r"data.max_bad_fraction=0.01. First: 00001.tar:byte 73728"):
        BadSampleLog(tmp_path, 0.01, damaged, rows=67)
    log = BadSampleLog(tmp_path, 0.2, damaged, rows=67)
    assert [json.loads(x) for x in (tmp_path / "bad_samples.jsonl").read_text().splitlines()] == [
        {"key": "00001.tar:byte 73728", "reason": "damaged tar: cut short", "lost": 13, "exact": True}]
    BadSampleLog(tmp_path, 0.2, damaged, rows=67)  # a resume: written once
    assert len((tmp_path / "bad_samples.jsonl").read_text().splitlines()) == 1
    # read failures add to the known loss: 16.25% + 2% of 300 read > 18% with confidence
    with pytest.raises(DataError, match="lost in damaged files"):
        for i in range(300):
            log.record(_batch(bad=2, good=2))
            log.add(*log.take())  # the trainer's step: one rank's counts are the world's
            if log.too_many():
                raise log.error(i + 1, log.last)


def _batch(bad: int, good: int):
    """What BadSampleLog.record reads of a batch: its length and the keys it replaced."""

    class Fake:
        errors = [(f"k{i}", "unreadable") for i in range(bad)]

        def __len__(self):
            return good

    return Fake()


@pytest.mark.timeout(400)
def test_two_ranks_train_on_img2dataset_shards_with_a_cut_one_and_resume_exactly(tmp_path_factory, shards, tmp_path):
    from kits.runkit import EVERY, assert_identical, assert_resumed_exactly, final_state, ok, session_shapes, train

    shapes = session_shapes(tmp_path_factory)  # its tokenizer: the fixtures' captions are shapes captions
    pattern = shards / PATTERN
    refused = one_process(shapes, tmp_path / "strict", data__train=pattern)  # data.max_bad_fraction=0.01
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "13 of 80 samples (16.25%) are lost in 1 damaged file(s), more than data.max_bad_fraction=0.01" \
        in refused.stderr
    failing = one_process(shapes, tmp_path / "fail", data__train=pattern, data__on_error="fail")
    assert failing.returncode == 1 and "Traceback" not in failing.stderr
    assert "set data.on_error: skip to train on what they still hold" in failing.stderr

    settings = {"data__train": pattern, "data__max_bad_fraction": 0.2, "data__audit": "true"}
    ref = tmp_path / "ref"
    done = ok(train(shapes, ref, **settings))
    assert "7 samples kept, 13 lost (of the 20 00001.parquet lists)" in done.stderr
    assert "bad samples: 13 lost in damaged files" in done.stdout
    [record] = [json.loads(x) for x in (ref / "bad_samples.jsonl").read_text().splitlines()]
    assert record["key"].startswith("00001.tar:byte ") and (record["lost"], record["exact"]) == (13, True)
    run = tmp_path / "run"
    stopped = train(shapes, run, fault="kill:at=step:step=6", **settings)
    assert stopped.returncode != 0
    resumed = ok(train(shapes, run, **settings))
    assert_resumed_exactly(resumed, run, EVERY)
    assert_identical(final_state(ref), final_state(run))
    assert len((run / "bad_samples.jsonl").read_text().splitlines()) == 1  # not again on resume


def one_process(shapes: Path, run_dir: Path, **extra):
    """``vltrain train`` without torchrun (which adds its own report of a failed worker)."""
    from kits.runkit import finish, launch, overrides

    return finish(launch(["train", shapes / "base.yaml", *overrides(shapes, run_dir, data__num_workers=0, **extra)]), 120)
