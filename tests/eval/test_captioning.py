"""Captioning as a user meets it: a tiny-coca run trained with ``eval.captions``, then ``vltrain
caption`` on 1 and 2 ranks (the same captions), ``vltrain eval --captions``, and the one-line
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kits.runkit import finish, launch, ok, session_shapes, train

from vltrain.eval.caption_metrics import caption_scores

pytestmark = pytest.mark.slow


def karpathy(shapes: Path) -> Path:
    """The shapes' held-out image-text rows as a Karpathy split file (one reference each)."""
    out = shapes / "karpathy.json"
    rows = [json.loads(x) for x in (shapes / "val.jsonl").read_text().splitlines()]
    images = [{"filename": r["image"], "split": "test", "sentences": [{"raw": r["text"]}]}
              for r in rows if r.get("image") and r.get("text")]
    out.write_text(json.dumps({"images": images}))
    return out


@pytest.fixture(scope="module")
def coca(tmp_path_factory):
    shapes = session_shapes(tmp_path_factory)
    sets = karpathy(shapes)
    run_dir = tmp_path_factory.mktemp("coca") / "run"
    captions = f"[{{name: shapes, path: {sets}, beam: 2}}]"
    proc = ok(train(shapes, run_dir, nproc=1, timeout=240, model__preset="tiny-coca", train__max_steps=30,
                    eval__captions=captions))
    return shapes, sets, run_dir, proc


def vltrain(*args: str, nproc: int = 1):
    """``vltrain ARGS`` on ``nproc`` ranks, started."""
    return launch(list(args), nproc)


def captions_of(started) -> list[str]:
    """The ``IMAGE\tCAPTION`` lines; each caption has words (paths that agree on nothing are no test)."""
    proc = ok(finish(started, 180))
    lines = [line for line in proc.stdout.splitlines() if "\t" in line]
    assert lines and all(line.split("\t", 1)[1].split() for line in lines), proc.stdout
    return lines


def test_a_run_with_eval_captions_reports_bleu_and_cider(coca):
    _, _, run_dir, proc = coca
    final = json.loads((run_dir / "eval.json").read_text())[-1]
    assert final["step"] == 30
    # 30 steps caption little (CIDEr-D 0.003, BLEU-1 0.02 on an AVX2 EPYC), but not nothing: an empty
    # or absent caption scores 0 on both
    assert final["captions/shapes/cider"] > 0 and final["captions/shapes/bleu1"] > 0
    assert final["captions/shapes/num_images"] > 5 and final["captions/shapes/num_unreadable"] == 0
    assert "caption 2" in proc.stderr  # the objective line names the caption weight


def test_captions_are_the_same_on_one_and_two_ranks_with_and_without_the_cache(coca):
    shapes, _, run_dir, _ = coca
    images = sorted(str(p) for p in (shapes / "images").rglob("*.png"))[:5]
    greedy = captions_of(vltrain("caption", str(run_dir), "--images", *images, "--batch-size", "2"))
    assert [line.split("\t")[0] for line in greedy] == images
    assert captions_of(vltrain("caption", str(run_dir), "--images", *images, "--no-cache")) == greedy
    # beam 3 on two ranks of other batches (top-p's per-image seeds: tests/model/test_decoder.py)
    beam = ["--beam", "3"]
    one = captions_of(vltrain("caption", str(run_dir), "--images", *images, "--batch-size", "2", *beam))
    two = captions_of(vltrain("caption", str(run_dir), "--images", *images, "--batch-size", "3", *beam, nproc=2))
    assert one == two


def test_eval_captions_scores_the_captions_caption_writes(coca, tmp_path):
    _, sets, run_dir, _ = coca
    proc = ok(finish(vltrain("eval", str(run_dir), "--captions", str(sets), "--json"), 180))
    metrics = json.loads(proc.stdout)
    data = json.loads(sets.read_text())["images"]
    paths = [str(sets.parent / im["filename"]) for im in data]
    out = tmp_path / "captions.jsonl"
    ok(finish(vltrain("caption", str(run_dir), "--images", *paths, "--out", str(out)), 180))
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [w["image"] for w in written] == paths
    assert all(w["caption"].split() for w in written)
    scores = caption_scores({i: [im["sentences"][0]["raw"]] for i, im in enumerate(data)},
                            {i: w["caption"] for i, w in enumerate(written)})
    assert metrics["captions/karpathy/bleu4"] == pytest.approx(scores["bleu4"], abs=1e-6)
    assert metrics["captions/karpathy/cider"] == pytest.approx(scores["cider"], abs=1e-6)


def test_captioning_mistakes_get_one_line(coca, tmp_path):
    shapes, _, run_dir, _ = coca
    image = str(next((shapes / "images").rglob("*.png")))
    clip = tmp_path / "clip"
    ok(train(shapes, clip, nproc=1, train__max_steps=1))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pictures": []}))
    cases = {
        ("caption", str(clip), "--images", image): "has no captioning decoder: train a preset with one",
        ("caption", str(run_dir), "--images", image, "--beam", "0"): "--beam must be >= 1",
        ("caption", str(run_dir), "--images", image, "--prompt", " ".join(["red"] * 40)):
            "context is 16: shorten the prompt",
        ("eval", str(run_dir), "--captions", str(bad)): "expected COCO-style JSON",
        ("caption", str(run_dir), "--images", image, "--batch-size", "0"): "--batch-size: must be at least 1, got 0",
        ("caption", str(run_dir), "--images", image, "--top-p", "0"): "--top-p: must be in (0, 1], got 0",
        ("caption", str(run_dir), "--images", image, "--max-length", "0"): "--max-length: must be at least 1, got 0",
        ("caption", str(run_dir), "--images", str(bad), str(bad)): "none of the 2 images could be read",
    }
    for args, said in cases.items():
        proc = finish(vltrain(*args), 120)
        assert proc.returncode != 0 and said in proc.stderr, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, args
        if ": must be" in said or "could be read" in said:  # a usage error, 2; nothing to caption at run time, 1
            assert proc.returncode == (2 if ": must be" in said else 1), (args, proc.returncode)


def test_a_run_started_from_a_captioning_run_takes_its_decoder(coca, tmp_path):
    """model.init of a vltrain run: its model section, the decoder and the caption loss included,
    also when the config empties model.preset (the run's architecture, not a preset's)."""
    from kits.runkit import overrides

    from vltrain.config.job import load_config
    from vltrain.errors import ConfigError
    from vltrain.model.config import ModelConfig
    from vltrain.compose.decide import decide

    shapes, _, run_dir, _ = coca
    for preset in ([], ["model.preset=''"]):
        given = [o for o in overrides(shapes, tmp_path / "run") if not o.startswith("model.preset=")]
        cfg = load_config(None, [*given, *preset, f"model.init={run_dir}"])
        decided = decide(cfg, 1).cfg
        assert decided.model.preset == "tiny-coca" and decided.model.loss.caption == 2
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        ModelConfig(preset="nope").architecture()
