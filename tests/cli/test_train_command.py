"""``vltrain train`` as a user meets it: what it prints for bad data, Ctrl-C, a refused resume, and
the overrides every command takes the same way."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from kits.runkit import make_shapes, overrides

from vltrain.checkpoint.storage import read_tensors
from vltrain.cli.main import build_parser
from vltrain.cli.model_commands import overrides_of
from vltrain.train.metrics import read_jsonl


def huge_png(path: Path, side: int = 10_000) -> None:
    """A PNG whose header says ``side`` x ``side`` pixels (over Pillow's and vltrain's limit): Pillow
    warns when it opens the header, and vltrain refuses the image as a bad sample."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("shapes"))


def _bombed(shapes: Path, tmp_path: Path, every: int) -> Path:
    """A copy of the training manifest where every ``every``-th image is a decompression bomb."""
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    with_image = [r for r in rows if "image" in r]
    for i, row in enumerate(with_image):
        row["image"] = str(shapes / row["image"])
        if i % every == 0:
            huge_png(tmp_path / f"huge-{i}.png")
            row["image"] = str(tmp_path / f"huge-{i}.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_images_are_counted_in_the_record_not_warned_about(shapes, tmp_path, cli):
    train = _bombed(shapes, tmp_path, every=5)
    run = tmp_path / "run"
    proc = cli("train", shapes / "base.yaml", *overrides(shapes, run, data__train=train, data__max_bad_fraction=0.5,
                                                         train__log_every=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DecompressionBombWarning" not in proc.stderr and "site-packages" not in proc.stderr
    replaced = len((run / "bad_samples.jsonl").read_text().splitlines())
    assert replaced > 0
    assert f"bad samples: {replaced} replaced ({run / 'bad_samples.jsonl'})" in proc.stdout.splitlines()[-1]
    logged = [r["data/bad_samples"] for r in read_jsonl(run / "metrics.jsonl") if "data/bad_samples" in r]
    assert logged == sorted(logged) and logged[-1] == replaced


def test_an_unreadable_set_stops_at_once_and_says_so_once(shapes, tmp_path, cli):
    train = _bombed(shapes, tmp_path, every=1)  # every image refused: text-only rows remain
    proc = cli("train", shapes / "base.yaml", *overrides(shapes, tmp_path / "run", data__train=train,
                                                         data__num_workers=0))
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "failed to load" in line]
    assert len(said) == 1 and said[0].startswith("vltrain: error: ") and "check it with `vltrain data validate" in said[0]
    assert "failed at step" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_region_stops_a_strict_run_in_one_line_naming_the_row(shapes, tmp_path, cli):
    """With data.on_error: fail a box outside its image stops the run: one error naming the row and
    the region, then what to do, no traceback."""
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    for row in rows:
        if "image" in row:
            row["image"] = str(shapes / row["image"])
            row["regions"] = [{"box": [0, 0, 40, 10], "text": "past the right edge"}]
    train = tmp_path / "regions.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = cli("train", shapes / "base.yaml", *overrides(shapes, tmp_path / "run", data__train=train,
                                                         data__on_error="fail", data__num_workers=0))
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("vltrain: error: ")]
    assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "regions.jsonl:" in said[0] and "regions[0]: box [0, 0, 40, 10] is not inside the 32x32 image" in said[0]
    assert "Set data.on_error: skip" in proc.stderr


def test_a_val_set_without_pairs_is_refused_at_start_up(shapes, tmp_path, cli):
    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in rows if "text" in r))
    proc = cli("train", shapes / "base.yaml", *overrides(shapes, tmp_path / "run", data__val=val))
    assert proc.returncode == 2
    assert f"data.val ({val}) holds no image-text pairs" in proc.stderr and "text-only, 0 image-only" in proc.stderr


@pytest.mark.timeout(240)
def test_ctrl_c_saves_the_step_exits_130_and_resumes_exactly(shapes, tmp_path):
    run = tmp_path / "run"
    args = overrides(shapes, run, train__max_steps=400, train__log_every=1, checkpoint__every=0)
    cmd = [sys.executable, "-m", "vltrain", "train", str(shapes / "base.yaml"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(read_jsonl(run / "metrics.jsonl")) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    line = next(x for x in err.splitlines() if "SIGINT at step" in x)
    step = int(line.split("SIGINT at step ")[1].split(":")[0])
    assert "run the same command again to resume" in line and "Traceback" not in err
    assert (run / "checkpoints" / f"step-{step}").is_dir() and not (run / "preempted.json").exists()
    again = subprocess.run(cmd[:-len(args)] + overrides(shapes, run, train__max_steps=step + 2, checkpoint__every=0),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {step} (exactly)" in again.stderr


def test_a_changed_batch_size_is_refused_with_a_way_forward_that_works(shapes, tmp_path, cli):
    first = tmp_path / "first"
    assert cli("train", shapes / "base.yaml", *overrides(shapes, first, train__max_steps=4)).returncode == 0
    refused = cli("train", shapes / "base.yaml", *overrides(shapes, first, train__max_steps=6, data__batch_size=8))
    assert refused.returncode != 0
    ckpt = first / "checkpoints" / "step-4"
    assert f"model.init={ckpt} run.dir=NEW_FOLDER" in refused.stderr

    second = tmp_path / "second"
    proc = cli("train", shapes / "base.yaml", *overrides(shapes, second, train__max_steps=2, data__batch_size=8),
               f"model.init={ckpt}", "checkpoint.save_initial=always")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    start = load_file(second / "init.safetensors")
    trained = {k.removeprefix("model."): v for k, v in read_tensors(ckpt).items() if k.startswith("model.")}
    assert start.keys() <= trained.keys() and all(torch.equal(start[k], trained[k]) for k in start)


def test_every_command_that_reads_a_config_takes_overrides_both_ways():
    parser = build_parser()
    given = ["train.lr=1e-3", "--set", "model.preset=tiny-clip"]
    for argv in (["train", "c.yaml", *given], ["eval", "run", *given], ["demo", *given],
                 ["embed", "m", *given, "--texts", "a dog", "--out", "e.npy"]):
        args = parser.parse_args(argv)
        assert overrides_of(args) == ["train.lr=1e-3", "model.preset=tiny-clip"], argv


def test_overrides_may_follow_the_options_of_a_command(capsys):
    from vltrain.cli.main import parse

    parser = build_parser()
    args = parse(parser, ["eval", "run", "--data", "val.jsonl", "eval.batch_size=64", "--json", "train.precision=fp32"])
    assert (args.data, args.json) == ("val.jsonl", True)
    assert overrides_of(args) == ["eval.batch_size=64", "train.precision=fp32"]
    args = parse(parser, ["embed", "m", "--texts", "a dog", "--out", "e.npy", "model.quick_gelu=true"])
    assert overrides_of(args) == ["model.quick_gelu=true"] and args.texts == ["a dog"]
    for argv in (["eval", "run", "--data", "v.jsonl", "--frobnicate"], ["export", "run", "--out", "x", "a=b"]):
        with pytest.raises(SystemExit):
            parse(parser, argv)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_exported_weights_can_be_read_by_others(tmp_path):
    from vltrain.checkpoint.storage import write_weights

    old = os.umask(0o022)
    try:
        write_weights(tmp_path / "model.safetensors", {"w": torch.ones(2)})
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
