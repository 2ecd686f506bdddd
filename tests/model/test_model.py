"""VLModel with its objectives: gradients reach every parameter for any modality mix, the task's
parts reproduce the whole step and the exact gradient-cached gradient, and the model protocol."""

from __future__ import annotations

import pytest
import torch
from kits.modelkit import forward_calls, grads, make_batch, max_relative_error, rows, small_model, small_task
from kits.multiproc import run_world

from vltrain.model.passes import Encode
from vltrain.compose.task import Contrastive, Score

MIXES = {
    "image-text": ([1, 1, 1, 1], [1, 1, 1, 1]),
    "text-only": ([0, 0, 0, 0], [1, 1, 1, 1]),
    "image-only": ([1, 1, 1, 1], [0, 0, 0, 0]),
    "mixed": ([1, 0, 1, 1], [1, 1, 0, 1]),
}
MODELS = {"clip": ("tiny-clip", dict(itc=1.0, siglip=0.5)), "albef": ("tiny-albef", dict(itm=1.0, mlm=1.0))}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("mix", MIXES)
def test_every_parameter_gets_a_finite_gradient(model_name, mix):
    preset, loss = MODELS[model_name]
    model = small_task(preset, **loss)
    has_image, has_text = MIXES[mix]
    out = model(Score(make_batch(4, has_image=has_image, has_text=has_text, weights=True)))
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert torch.isfinite(out.loss)
    if mix in ("text-only", "image-only"):
        assert out.loss.item() == 0.0
        assert all(not p.grad.any() for p in model.parameters())


def test_output_fields():
    model = small_task("tiny-albef", itm=1.0, mlm=1.0)
    out = model(Score(make_batch(4, has_image=[1, 0, 1, 1])))
    assert set(out.losses) == {"itc", "itm", "mlm"}
    assert out.image_embeds.shape == out.text_embeds.shape == (4, 128)
    torch.testing.assert_close(out.text_embeds.norm(dim=1), torch.ones(4))
    assert not out.image_embeds[1].any()
    assert out.itm_logits.shape == (12, 2)
    assert out.logit_scale.item() == pytest.approx(1 / 0.07, rel=1e-5)


def test_dual_encoder_ignores_fusion_objectives():
    task = small_task("tiny-clip", itm=1.0, mlm=1.0)
    assert task.model.fusion is None and task.model.itm_head is None and task.model.mlm_head is None
    assert set(task.objectives.loss_weights) == {"itc"}
    assert set(task(Score(make_batch(2))).losses) == {"itc"}


def test_all_equals_the_objectives_of_encode():
    task = small_task("tiny-albef", itm=1.0)
    batch = make_batch(4, has_text=[1, 1, 0, 1])
    torch.manual_seed(5)
    a = task(Score(batch))
    torch.manual_seed(5)
    b = task.objectives.score(task.model, task(Encode(batch)), batch)
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("model_name", MODELS)
def test_gradient_cached_accumulation_is_exact(model_name):
    """Two micro-batches: cached-embedding surrogate + objectives(contrastive=False) per micro-batch
    reproduces the gradient of the contrastive loss over the whole batch plus the per-micro-batch
    objectives."""
    preset, loss = MODELS[model_name]
    batch = make_batch(8, seed=4, has_image=[1, 1, 0, 1, 1, 1, 1, 1], weights=True)
    micro = [rows(batch, slice(i * 4, (i + 1) * 4)) for i in range(2)]

    # reference: contrastive on the full batch, other objectives per micro-batch (as gradcache defines it)
    task = small_task(preset, **loss)
    encs = [task(Encode(m)) for m in micro]
    total, _ = task(Contrastive(torch.cat([e.image_embeds for e in encs]), torch.cat([e.text_embeds for e in encs]),
                    batch.rows()))
    torch.manual_seed(1)
    for e, m in zip(encs, micro):
        total = total + task.objectives.score(task.model, e, m, contrastive=False).loss
    total.backward()
    expected = grads(task)

    # gradcache: embeddings without a graph, contrastive gradient w.r.t. them, then replay per micro-batch
    cached = small_task(preset, **loss)
    with torch.no_grad():
        encs = [cached(Encode(m)) for m in micro]
    img = torch.cat([e.image_embeds for e in encs]).requires_grad_()
    txt = torch.cat([e.text_embeds for e in encs]).requires_grad_()
    cached(Contrastive(img, txt, batch.rows()))[0].backward()
    torch.manual_seed(1)
    for i, m in enumerate(micro):
        e = cached(Encode(m))
        surrogate = (e.image_embeds * img.grad[i * 4 : (i + 1) * 4]).sum() + (e.text_embeds * txt.grad[i * 4 : (i + 1) * 4]).sum()
        out = cached.objectives.score(cached.model, e, m, contrastive=False)
        (surrogate + out.loss).backward()
    assert max_relative_error(grads(cached), expected) < 1e-5


def test_activation_checkpointing_keeps_gradients():
    """Every tower's blocks are recomputed in the backward, and the gradients are those without."""
    batch = make_batch(4, has_image=[1, 0, 1, 1])
    runs = {}
    for enabled in (False, True):
        task = small_task("tiny-albef", itm=1.0)
        task.model.set_activation_checkpointing(enabled)
        towers = (task.model.vision, task.model.text, task.model.fusion)
        torch.manual_seed(0)
        with forward_calls(*(t.blocks[0] for t in towers)) as calls:
            task(Score(batch)).loss.backward()
        runs[enabled] = task, calls
    (plain, once), (ckpt, twice) = runs[False], runs[True]
    assert once == [1, 1, 1] and twice == [2, 2, 2]
    assert max_relative_error(grads(ckpt), grads(plain)) < 1e-6


def test_no_weight_decay_names():
    model = small_model("tiny-albef", itm=1.0, mlm=1.0, siglip=1.0)
    names = model.no_weight_decay()
    params = dict(model.named_parameters())
    assert {"logit_scale", "logit_bias", "vision.cls_token", "vision.pos_embed", "text.token_embedding.weight"} <= names
    assert all(params[n].ndim < 2 for n in names if "norm" in n or n.endswith(".bias"))
    assert "vision.blocks.0.attn.qkv.weight" not in names and "image_proj.proj.weight" not in names


def test_blocks_for_sharding_and_flops():
    clip = small_model("tiny-clip")
    albef = small_model("tiny-albef", itm=1.0, mlm=1.0)
    assert len(clip.blocks_for_sharding()) == 3 + 3
    assert len(albef.blocks_for_sharding()) == 3 + 3 + 1
    assert albef.flops_per_sample() > clip.flops_per_sample() > 0
    assert clip.flops_per_sample(4) < clip.flops_per_sample(8)
    # about 2 FLOPs per weight per token in the blocks, plus the patch embedding, times 3 for training
    v = clip.vision
    dense = sum(p.numel() for n, p in v.blocks.named_parameters() if p.ndim == 2)
    assert 2 * dense * v.num_tokens <= v.flops() <= 1.5 * 2 * dense * v.num_tokens + 2 * 3 * 64 * 128 * 16


def test_mlm_needs_a_mask_token():
    from vltrain.errors import UserError
    from vltrain.model import build_model
    from vltrain.model.config import LossConfig, ModelConfig

    with pytest.raises(UserError, match="mask token"):
        build_model(ModelConfig(preset="tiny-albef", loss=LossConfig(mlm=1.0)), vocab_size=10, pad_id=0, mask_id=None,
                    image_size=32, max_text_length=8)


def _itm_worker(rank, world):
    task = small_task("tiny-albef", itm=1.0, itm_negatives="global")
    # ids repeat across ranks (0..3 on both) and within rank 1; rank 1 row 3 has no text
    ids = [[0, 1, 2, 3], [0, 1, 3, 3]][rank]
    batch = make_batch(4, seed=rank, ids=ids, has_text=[1, 1, 1, 1] if rank == 0 else [1, 1, 1, 0])
    enc = task(Encode(batch))
    draws = []
    for _ in range(50):
        pairs = task.objectives.itm_pairs(enc, batch, task.model.logit_scale)
        draws.append((pairs.negative_text_ids, pairs.negative_image_ids, pairs.pair_weights))
    return batch.ids, draws


@pytest.mark.timeout(120)
def test_itm_negatives_never_share_the_id_across_ranks():
    seen = set()
    for ids, draws in run_world(_itm_worker, timeout=60):
        for neg_text, neg_image, w in draws:
            b = ids.shape[0]
            text_used, image_used = w[b : 2 * b] > 0, w[2 * b :] > 0
            assert (neg_text[text_used] != ids[text_used]).all()
            assert (neg_image[image_used] != ids[image_used]).all()
            seen.update(neg_text[text_used].tolist())
    assert len(seen) > 2  # the negatives do come from several samples, incl. other ranks' ones


@pytest.mark.parametrize("model_name", MODELS)
def test_bf16_autocast(model_name):
    preset, loss = MODELS[model_name]
    model = small_task(preset, **loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(Score(make_batch(4, has_image=[1, 0, 1, 1], weights=True)))
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
