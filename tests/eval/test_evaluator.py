"""Retrieval recall on known rankings, and eval.json history."""

from __future__ import annotations

import json

import pytest
import torch

from vltrain.eval.evaluator import append_eval, recall_at_k, retrieval_metrics


def test_perfect_embeddings_recall_one():
    x = torch.nn.functional.normalize(torch.randn(50, 16), dim=-1)
    m = retrieval_metrics(x, x)
    assert m["i2t_r1"] == m["t2i_r1"] == 1.0 and m["num_pairs"] == 50


def test_known_ranks():
    # query i's correct key ranks at position i (0-based): keys score [.., correct, ..] by construction
    n = 12
    keys = torch.eye(n)
    query = torch.zeros(n, n)
    for i in range(n):
        query[i, i] = 0.5
        query[i, :i] = 1.0  # i keys score higher than the correct one
    r = recall_at_k(query, keys, ks=(1, 5, 10), chunk=5)
    assert r[1] == pytest.approx(1 / n) and r[5] == pytest.approx(5 / n) and r[10] == pytest.approx(10 / n)


def test_directions_differ_when_asymmetric():
    img = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    txt = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    m = retrieval_metrics(img, txt)
    # both images prefer text 0: image 1 misses at R@1; both texts see the two images tie,
    # and a tie counts as a miss
    assert m["i2t_r1"] == 0.5
    assert m["t2i_r1"] == 0.0 and m["t2i_r5"] == 1.0


def test_collapsed_embeddings_score_nothing():
    x = torch.ones(20, 4)
    assert retrieval_metrics(x, x)["t2i_r1"] == 0.0


def test_append_eval_keeps_history(tmp_path):
    append_eval(tmp_path, 10, {"t2i_r1": 0.1})
    append_eval(tmp_path, 20, {"t2i_r1": 0.2})
    append_eval(tmp_path, 20, {"t2i_r1": 0.3})
    hist = json.loads((tmp_path / "eval.json").read_text())
    assert hist == [{"step": 10, "t2i_r1": 0.1}, {"step": 20, "t2i_r1": 0.3}]


def test_every_metric_is_rounded_alike_in_eval_json(tmp_path):
    append_eval(tmp_path, 5, {"i2t_r1": 0.645, "zeroshot/pets/top1": 65 / 180,
                              "zeroshot/pets/mean_per_class": 0.36111111111111116, "num_pairs": 1000})
    (row,) = json.loads((tmp_path / "eval.json").read_text())
    assert row == {"step": 5, "i2t_r1": 0.645, "zeroshot/pets/top1": 0.361111,
                   "zeroshot/pets/mean_per_class": 0.361111, "num_pairs": 1000}


def test_each_evaluation_line_says_what_it_was_measured_on():
    from vltrain.eval.evaluator import format_metrics

    line = format_metrics({"i2t_r1": 0.5, "t2i_r1": 0.25, "num_pairs": 3, "zeroshot/pets/top1": 0.2,
                           "zeroshot/pets/num_images": 30})
    assert line == "i2t_r1=0.500  t2i_r1=0.250  [3 pairs]  zeroshot/pets/top1=0.200 [30 images]"
    line = format_metrics({"captions/coco/bleu4": 0.3, "captions/coco/cider": 1.05, "captions/coco/num_images": 40})
    assert line == "captions/coco/cider=1.050 [40 images]"
    line = format_metrics({"dense/shapes/miou": 0.34, "dense/shapes/iou_background": 0.98, "dense/shapes/num_images": 24})
    assert line == "dense/shapes/miou=0.340 [24 images]"


def test_max_samples_scores_the_first_pairs_on_any_number_of_ranks(tmp_path):
    from vltrain.config.job import JobConfig
    from vltrain.data.ids import stable_uid
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer
    from vltrain.runtime.distributed import World
    from vltrain.compose.builders import build_tokenizer, build_val_loader

    synthesize(tmp_path, 40, 0, text_only_fraction=0.3, seed=0, image_size=16)
    train_tokenizer(source_texts([str(tmp_path / "train.jsonl")]), tmp_path / "tok.json", vocab_size=120)
    cfg = JobConfig()
    cfg.data.val, cfg.data.tokenizer, cfg.data.image_size, cfg.data.num_workers = (
        str(tmp_path / "train.jsonl"), str(tmp_path / "tok.json"), 16, 0)
    cfg.eval.max_samples = 10
    tokenizer = build_tokenizer(cfg)
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert any("image" not in r for r in rows[:15])  # text-only rows among the first pairs
    first = [r["id"] for r in rows if "image" in r and "text" in r][:10]

    def pairs_scored(world: int, batch_size: int) -> list[str]:
        cfg.eval.batch_size = batch_size
        seen = []
        for rank in range(world):
            for batch in build_val_loader(cfg, tokenizer, World(rank, world, 0, torch.device("cpu"))):
                seen += [int(i) for i, im, tx in zip(batch.ids, batch.has_image, batch.has_text) if im and tx]
        return sorted(set(seen))

    one = pairs_scored(1, 64)
    assert len(one) == 10
    assert pairs_scored(2, 4) == pairs_scored(3, 3) == one
    assert sorted(stable_uid(i) for i in first) == one
