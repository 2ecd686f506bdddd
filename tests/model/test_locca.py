"""LocCa's decoder rows and objectives (vltrain.model.locca, vltrain.objectives.locca): the rows each
task writes, causal against parallel decoding, the keyed region draw, and the step's means on any
split of a batch."""

import pytest
import torch

from vltrain.boxes import LocCaVocab, box_iou, from_bins, task_rows, to_bins
from vltrain.images import Images
from vltrain.model.builder import build_model
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.objectives.keyed import StepKey
from vltrain.objectives.scoring import Objectives
from vltrain.types import ModelInputs

VOCAB = LocCaVocab(text=10, bins=5)  # box tokens 10..14, caption 15, referring 16, grounded 17, mask 18
PAD = 0


def test_rows_causal_and_parallel():
    prefix = torch.tensor([[3, 4, 0], [5, 0, 0]])
    target = torch.tensor([[6, 7], [8, 9]])
    rows = task_rows(VOCAB.referring, prefix, torch.tensor([2, 1]), target, torch.tensor([2, 1]),
                     torch.tensor([False, True]), VOCAB, PAD)
    assert rows.ids.tolist() == [[16, 3, 4, 6, 7, 0], [16, 5, 18, 0, 0, 0]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    # causal: the position before a target token predicts it; parallel: the mask token's own position
    assert rows.labels.tolist() == [[-100, -100, 6, 7, -100, -100], [-100, -100, 8, -100, -100, -100]]


def test_boxes_round_trip_to_bins():
    boxes = torch.tensor([[0.0, 0.1, 0.5, 0.999], [0.2, 0.2, 1.0, 0.7]])
    tokens = to_bins(boxes, 1000)
    assert tokens.tolist() == [[0, 100, 500, 999], [200, 200, 999, 700]]
    assert torch.allclose(from_bins(tokens, 1000), boxes, atol=1e-3)
    assert box_iou(torch.tensor([0.0, 0, 0.5, 1]), torch.tensor([0.25, 0, 0.75, 1])).item() == pytest.approx(1 / 3)


def _model(**loss):
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny-siglip2", loss=LossConfig(itc=0, siglip=1, **loss))
    model = build_model(cfg, vocab_size=50, pad_id=0, mask_id=1, image_size=48, max_text_length=12)
    return model, Objectives(cfg.loss, model.spec)


def _inputs(b: int = 6, seed: int = 1) -> ModelInputs:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (b, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.randint(3, 12, (b, 1), generator=g)).long()
    boxes = torch.rand(b, 3, 4, generator=g).sort(-1).values[..., [0, 2, 1, 3]]
    phrases = torch.randint(2, 50, (b, 3, 5), generator=g)
    phrase_mask = (torch.arange(5)[None, None] < torch.randint(1, 6, (b, 3, 1), generator=g)).long()
    count = torch.tensor([3, 0, 1, 2, 0, 1][:b])
    has_image = torch.tensor([True, True, True, False, True, True][:b])
    has_text = torch.tensor([True, True, False, True, True, True][:b])
    real = torch.arange(3)[None] < count[:, None]
    images = Images(torch.randn(b, 3, 48, 48, generator=g), boxes=boxes * real[..., None], box_mask=real)
    return ModelInputs(images, ids, mask, has_image, has_text, torch.arange(100, 100 + b), region_ids=phrases,
                       region_attention_mask=phrase_mask * real[..., None])


def _rows(inputs: ModelInputs, lo: int, hi: int) -> ModelInputs:
    return ModelInputs(inputs.images[lo:hi], inputs.input_ids[lo:hi], inputs.attention_mask[lo:hi],
                       inputs.has_image[lo:hi], inputs.has_text[lo:hi], inputs.ids[lo:hi],
                       region_ids=inputs.region_ids[lo:hi], region_attention_mask=inputs.region_attention_mask[lo:hi])


def test_every_task_trains_and_is_split_invariant():
    """The batch scored whole equals its two halves scored with the step's denominators: each
    task's loss is a mean over the step's tokens whatever the split, and its draws are keyed."""
    model, objectives = _model()
    inputs = _inputs()
    key = StepKey(seed=3, step=7)
    whole = objectives.score(model, model.encode(_keyed(inputs, objectives, key)), _keyed(inputs, objectives, key))
    for name in ("caption", "referring", "grounded_caption"):
        assert whole.losses[name].item() > 1.0, name  # a cross-entropy over ~1,000 tokens
    halves = [_rows(inputs, 0, 3), _rows(inputs, 3, 6)]
    totals = objectives.local_totals([_keyed(h, objectives, key) for h in halves])
    key = StepKey(3, 7, dict(zip(objectives.averaged, totals)))
    split = {k: 0.0 for k in whole.losses if k != "siglip"}
    for h in halves:
        h = _keyed(h, objectives, key)
        out = objectives.score(model, model.encode(h), h, contrastive=False)
        for k in split:
            split[k] += out.losses[k].item()
    for k, v in split.items():
        assert v == pytest.approx(whole.losses[k].item(), rel=1e-5), k


def _keyed(inputs: ModelInputs, objectives: Objectives, key: StepKey) -> ModelInputs:
    from dataclasses import replace

    return replace(inputs, key=key)


def test_parallel_rows_read_no_target_and_causal_rows_no_future():
    model, objectives = _model()
    vocab = model.decoder.vocab
    prefix = torch.tensor([[3, 4]] * 2)
    target = torch.tensor([[5, 6, 7], [5, 6, 7]])
    changed = torch.tensor([[5, 6, 9], [5, 6, 9]])
    image = model.encode(_inputs(2)).image_tokens
    has = torch.tensor([True, True])
    for parallel in (False, True):
        p = torch.tensor([parallel, parallel])
        a = task_rows(vocab.referring, prefix, torch.tensor([2, 2]), target, torch.tensor([3, 3]), p, vocab, 0)
        b = task_rows(vocab.referring, prefix, torch.tensor([2, 2]), changed, torch.tensor([3, 3]), p, vocab, 0)
        la, lb = model.locca_logits(a, image, has), model.locca_logits(b, image, has)
        if parallel:  # the target is all mask tokens: nothing of it reaches the logits
            assert torch.equal(la, lb)
        else:  # the last target token is read by no position that predicts a target token
            picked = a.labels[0] != -100
            assert torch.allclose(la[:, picked], lb[:, picked], atol=1e-6)
            assert not torch.allclose(la[:, -1], lb[:, -1])


def test_parallel_probability_changes_the_rows():
    inputs = _inputs()
    key = StepKey(seed=3, step=7)
    rows = {}
    for p in (0.0, 1.0):
        _, objectives = _model(parallel_prediction=p)
        rows[p] = objectives.locca.rows(inputs, key)[0]
    assert not rows[0.0].parallel.any() and rows[1.0].parallel.all()
    assert (rows[1.0].ids == objectives.locca.vocab.mask).any() and not (rows[0.0].ids == objectives.locca.vocab.mask).any()


def test_region_draw_is_keyed_by_step_and_sample():
    _, objectives = _model()
    inputs = _inputs()
    picks = [objectives.locca.pick(inputs, StepKey(3, step)) for step in range(8)]
    assert picks[0].rows.tolist() == [0, 2, 5]  # rows with an image and a region (row 3 has no image)
    chosen = torch.stack([p.phrase[0] for p in picks])
    assert len({tuple(c.tolist()) for c in chosen}) > 1  # row 0's three regions are drawn across steps
    again = objectives.locca.pick(_rows(inputs, 0, 1), StepKey(3, 5))
    assert torch.equal(again.phrase[0], picks[5].phrase[0])  # the same row alone: the same draw


def test_referring_weight_zero_leaves_its_targets_out():
    _, objectives = _model(referring=0.0)
    assert "referring" not in objectives.loss_weights
    rows, task, _ = objectives.locca.rows(_inputs(), StepKey(3, 7))
    assert (rows.labels[task == 1] == -100).all()
    assert (rows.labels[task == 2] != -100).any()


def test_ground_and_describe_write_boxes_and_phrases():
    """Greedy decoding writes box tokens for a phrase and text tokens for a box, and reads the image:
    a decoder whose logits favour one box token writes that box."""
    from vltrain.model.locca import describe, ground
    from vltrain.model.passes import direct

    model, _ = _model()
    vocab = model.decoder.vocab
    image = model.encode(_inputs(2)).image_tokens
    phrases = torch.tensor([[3, 4, 5], [6, 7, 0]])
    with torch.no_grad():  # every position's states: the final norm's bias; the likeliest tokens: 7 and bin 250
        decoder = model.decoder
        decoder.norm.weight.zero_()
        decoder.norm.bias.normal_()
        out = decoder.token_embedding.weight  # tied: the map to the vocabulary
        out.zero_()
        out[[7, vocab.box + 250, vocab.mask]] = decoder.norm.bias
        boxes = ground(direct(model), vocab, image, phrases, torch.tensor([3, 2]), 0)
        words = describe(direct(model), vocab, image, torch.tensor([[0.1, 0.1, 0.5, 0.5]] * 2), 6, 2, 0)
        out[2] = 2 * decoder.norm.bias  # now the end token: phrases of one token
        ended = describe(direct(model), vocab, image, torch.tensor([[0.1, 0.1, 0.5, 0.5]] * 2), 6, 2, 0)
    assert torch.allclose(boxes, torch.full((2, 4), 250.5 / 1000))
    assert words == [[7] * 6] * 2 and ended == [[2]] * 2


def test_chunked_logits_give_the_same_losses_and_gradients():
    """model.loss.caption_chunk: LocCa's three losses and every gradient as with all the logits at once."""
    inputs = _inputs()
    key = StepKey(seed=3, step=7)
    grads, losses = [], []
    for chunk in (0, 5):
        model, objectives = _model(caption_chunk=chunk)
        keyed = _keyed(inputs, objectives, key)
        out = objectives.score(model, model.encode(keyed), keyed)
        out.loss.backward()
        losses.append(out.losses)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for name in ("caption", "referring", "grounded_caption"):
        assert losses[1][name].item() == pytest.approx(losses[0][name].item(), rel=1e-6, abs=1e-6), name
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-6), name


def test_parallel_grounding_reads_the_mask_positions():
    """ground(parallel=True): the four box tokens at once, from the mask positions after the phrase."""
    from vltrain.model.locca import ground
    from vltrain.model.passes import direct

    model, _ = _model()
    vocab = model.decoder.vocab
    image = model.encode(_inputs(2)).image_tokens
    phrases = torch.tensor([[3, 4, 5], [6, 7, 0]])
    with torch.no_grad():
        decoder = model.decoder
        decoder.norm.weight.zero_()
        decoder.norm.bias.normal_()
        out = decoder.token_embedding.weight
        out.zero_()
        out[vocab.box + 640] = decoder.norm.bias  # every position's favourite box token: bin 640
        causal = ground(direct(model), vocab, image, phrases, torch.tensor([3, 2]), 0)
        parallel = ground(direct(model), vocab, image, phrases, torch.tensor([3, 2]), 0, parallel=True)
    assert torch.allclose(parallel, torch.full((2, 4), 640.5 / 1000)) and torch.allclose(parallel, causal)
