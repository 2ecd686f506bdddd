"""Multi-caption retrieval: the protocol on a case worked by hand, ITM re-ranking, the caption files."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

from vltrain.eval.captions import open_captions
from vltrain.eval.embedding import Embedded
from vltrain.eval.retrieval import itm_rerank, multi_caption_recall, recall_with_rerank
from vltrain.model.passes import ItmLogits
from vltrain.types import Tokens


def test_multi_caption_protocol_on_a_hand_worked_case():
    # image 0 owns captions 0 and 1, image 1 owns captions 2 and 3
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    captions = torch.tensor([[0.6, 0.8], [1.0, 0.0], [0.0, 1.0], [0.8, 0.6]])
    m = multi_caption_recall(images, captions, torch.tensor([0, 0, 1, 1]))
    # t2i: caption 0 prefers image 1 and caption 3 image 0: half the captions find their image first
    assert m["t2i_r1"] == 0.5 and m["t2i_r5"] == 1.0
    # i2t: image 0's best caption is caption 1 (1.0), image 1's is caption 2: each found by one of its captions
    assert m["i2t_r1"] == 1.0
    # a tie between a wrong caption and the best right one counts against
    tied = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert multi_caption_recall(images, tied, torch.tensor([0, 0, 1, 1]))["i2t_r1"] == 0.5


class MatchingHead(torch.nn.Module):
    """``task(ItmLogits(...))``: a match when the text's first feature equals the image's (the pair's id)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, computation):
        assert isinstance(computation, ItmLogits)
        text_tokens, attention_mask, image_tokens = (computation.text_tokens, computation.attention_mask,
                                                     computation.image_tokens)
        assert attention_mask.shape[1] == text_tokens.shape[1]
        assert image_tokens.cross_mask is None  # square images: every token real
        self.calls += 1
        match = (text_tokens[:, 0, 0] == image_tokens.values[:, 0, 0]).float() * 4 - 2
        return torch.stack([-match, match], dim=1)


def _noisy_set(n: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, 8, generator=g), dim=-1)
    txt = F.normalize(img + 0.9 * torch.randn(n, 8, generator=g), dim=-1)
    ids = torch.arange(n, dtype=torch.float32)
    images = Embedded(img, torch.ones(n, dtype=torch.bool), Tokens(ids.view(n, 1, 1).expand(n, 2, 3).clone()))
    texts = Embedded(txt, torch.ones(n, dtype=torch.bool), ids.view(n, 1, 1).expand(n, 5, 3).clone(),
                     torch.ones(n, 5, dtype=torch.long))
    return images, texts


def test_an_itm_head_that_knows_the_pairs_lifts_recall_at_1_to_one():
    images, texts = _noisy_set()
    head = MatchingHead()
    m = recall_with_rerank(head, images, texts, torch.arange(12), rerank_k=12, batch_size=7,
                           autocast=contextlib.nullcontext)
    assert m["i2t_r1"] < 1.0 and m["t2i_r1"] < 1.0  # the embeddings alone miss some
    assert m["itm_i2t_r1"] == 1.0 and m["itm_t2i_r1"] == 1.0
    assert head.calls == -(-2 * 12 * 12 // 7)  # all pairs, batched


def test_reranking_reorders_only_the_top_k():
    images, texts = _noisy_set()
    (i2t, scores), _ = itm_rerank(MatchingHead(), images, texts, 3, 64, contextlib.nullcontext)
    assert i2t.shape == scores.shape == (12, 3)
    m = recall_with_rerank(MatchingHead(), images, texts, torch.arange(12), 3, 64, contextlib.nullcontext)
    # a true pair outside an image's top 3 stays where it was: recall at 10 is the embeddings'
    assert m["itm_i2t_r10"] == m["i2t_r10"]
    assert m["itm_i2t_r1"] >= m["i2t_r1"]


def test_karpathy_split_and_annotations_files(tmp_path):
    karpathy = {"images": [
        {"filepath": "val2014", "filename": "a.jpg", "split": "test", "sentences": [{"raw": "one"}, {"raw": "two"}]},
        {"filepath": "val2014", "filename": "b.jpg", "split": "train", "sentences": [{"raw": "three"}]},
        {"filepath": "val2014", "filename": "c.jpg", "split": "test", "sentences": [{"raw": "four"}]},
    ]}
    (tmp_path / "k.json").write_text(json.dumps(karpathy))
    got = open_captions(tmp_path / "k.json", "test")
    assert got.images == [str(tmp_path / "val2014" / "a.jpg"), str(tmp_path / "val2014" / "c.jpg")]
    assert got.captions == ["one", "two", "four"] and got.image_of == [0, 0, 1]
    annotations = {"images": [{"id": 7, "file_name": "x.jpg"}, {"id": 3, "file_name": "y.jpg"}],
                   "annotations": [{"image_id": 7, "caption": "p"}, {"image_id": 3, "caption": "q"},
                                   {"image_id": 7, "caption": "r"}]}
    (tmp_path / "a.json").write_text(json.dumps(annotations))
    got = open_captions(tmp_path / "a.json", image_root=tmp_path / "imgs")
    assert got.images == [str(tmp_path / "imgs" / "y.jpg"), str(tmp_path / "imgs" / "x.jpg")]
    assert got.captions == ["q", "p", "r"] and got.image_of == [0, 1, 1]
    with pytest.raises(Exception, match="split 'val'"):
        open_captions(tmp_path / "k.json", "val")
