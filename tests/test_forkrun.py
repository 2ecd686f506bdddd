"""The tests' forked ``vltrain`` commands (``kits.forkrun``) behave as launched ones: each its own
process with the working folder, environment, streams and exit status it was given."""

from __future__ import annotations

import os

from kits import forkrun, runkit


def test_a_forked_command_has_its_own_folder_environment_streams_and_status(tmp_path):
    (tmp_path / "rel").mkdir()
    made = forkrun.run(["data", "synth", "--out", "rel/shapes", "--num", "8", "--val", "4", "--image-size", "16"],
                       cwd=tmp_path, timeout=120)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "rel" / "shapes" / "train.jsonl").exists()  # relative to the folder it was given

    refused = forkrun.run(["train", "missing.yaml"], cwd=tmp_path, env=dict(os.environ, RANK="1"), timeout=60)
    assert refused.returncode == 2, refused.stderr  # a config error's code, as `python -m vltrain` exits
    assert refused.stderr == "vltrain[rank 1]: error: config file missing.yaml does not exist\n"  # its env
    assert refused.stdout == ""
    assert "RANK" not in os.environ or os.environ["RANK"] != "1"  # and not this process's


def test_a_world_of_forked_ranks_stops_the_rest_when_one_fails_and_reports_it(tmp_path):
    """Every rank of a 2-rank command reads its own RANK; one that fails makes the whole exit 1."""
    shapes = runkit.make_shapes(tmp_path / "shapes")
    proc = runkit.finish(runkit.launch(["train", shapes / "base.yaml",
                                        *runkit.overrides(shapes, tmp_path / "run", train__max_steps=2)], 2), 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "global batch 8 = data.batch_size 4 x train.accumulation 1 x 2 rank(s)" in proc.stderr

    bad = runkit.finish(runkit.launch(["train", shapes / "base.yaml",
                                       *runkit.overrides(shapes, tmp_path / "bad", data__batch_size=0)], 2), 120)
    assert bad.returncode == 1 and "data.batch_size" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
