"""Zero-shot and multi-caption retrieval sets in the loop and from `vltrain eval`, on a fusion model."""

from __future__ import annotations

import json

import pytest
from kits.runkit import assert_recalls, make_shapes, overrides


def _karpathy(shapes, out):
    """The shapes val pairs as a Karpathy-style file: two images, each with its caption twice over."""
    rows = [json.loads(line) for line in open(shapes / "val.jsonl")][:8]
    images = [{"filepath": "", "filename": r["image"], "split": "test",
               "sentences": [{"raw": r["text"]}, {"raw": r["text"].upper()}]} for r in rows]
    out.write_text(json.dumps({"images": images}))
    return out


@pytest.mark.timeout(300)
def test_sets_are_evaluated_in_the_loop_and_by_the_eval_command(cli, tmp_path):
    shapes = make_shapes(tmp_path / "shapes")
    classify = tmp_path / "classify"
    proc = cli("data", "synth", "--classify", classify, "--per-class", 4, "--image-size", 32)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in classify.iterdir() if p.is_dir()) == ["circle", "cross", "diamond", "square",
                                                                          "star", "triangle"]
    (classify / "star" / "0001.png").write_bytes(b"not a png")
    coco = _karpathy(shapes, shapes / "coco.json")
    run = tmp_path / "run"
    sets = [f"eval.zeroshot=[{{name: shapes, path: {classify}, templates: {classify / 'templates.txt'}}}]",
            f"eval.retrieval=[{{name: coco, path: {coco}}}]"]
    args = overrides(shapes, run, **{"model.preset": "tiny-albef", "model.loss.itm": 0.5, "train.max_steps": 2,
                                     "eval.every": 1, "eval.batch_size": 8, "eval.itm_rerank_k": 4,
                                     "eval.early_stop_metric": "zeroshot/shapes/top1", "eval.early_stop_patience": 5,
                                     "checkpoint.every": 0, "data.num_workers": 0})
    proc = cli("train", shapes / "base.yaml", *args, *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((run / "eval.json").read_text())
    assert [h["step"] for h in history] == [1, 2]
    last = history[-1]
    assert last["zeroshot/shapes/num_images"] == 23 and last["zeroshot/shapes/num_unreadable"] == 1
    assert last["retrieval/coco/num_images"] == 8 and last["retrieval/coco/num_captions"] == 16
    assert_recalls(last, "retrieval/coco/", images=8, captions=16, rerank_k=4)
    logged = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert any("zeroshot/shapes/top1" in r for r in logged)

    proc = cli("eval", run, "train.threads=1", "--zeroshot", classify, "--templates", classify / "templates.txt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zeroshot/classify" in proc.stdout and "top1" in proc.stdout and "0001.png" in proc.stderr
    proc = cli("eval", run, "train.threads=1", "eval.itm_rerank_k=4", "--retrieval", coco, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    coco = {k: v for k, v in last.items() if k.startswith("retrieval/coco/")}
    assert {k: printed[k] for k in coco} == coco  # the final checkpoint, re-ranked the same way
    assert "t2i_r1" not in printed  # only the sets asked for


def test_unknown_early_stop_metric_names_the_ones_there():
    from vltrain.errors import ConfigError
    from vltrain.eval.evaluator import check_early_stop_metric

    with pytest.raises(ConfigError, match="zeroshot/x/top1"):
        check_early_stop_metric("zeroshot/y/top1", {"zeroshot/x/top1": 0.5, "zeroshot/x/num_images": 3})


def test_eval_sets_need_a_name_and_a_path():
    from vltrain.config.job import load_config
    from vltrain.errors import ConfigError

    with pytest.raises(ConfigError, match="eval.zeroshot needs a name"):
        load_config(None, ["eval.zeroshot=[{path: x}]"])
    with pytest.raises(ConfigError, match="names must differ"):
        load_config(None, ["eval.retrieval=[{name: a, path: x}, {name: a, path: y}]"])
