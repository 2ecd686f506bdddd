"""The chunked cross-entropy (vltrain.objectives.chunked): F.cross_entropy's values and gradients
without the [tokens x vocabulary] logits, alone and as the caption objective (model.loss.caption_chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kits.modelkit import MASK, PAD, VOCAB, make_batch

from vltrain.compose.task import Score, Task
from vltrain.config.job import load_config
from vltrain.errors import ConfigError
from vltrain.model import build_model
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.model.decoder import DecoderConfig
from vltrain.model.presets import tiny_coca
from vltrain.objectives.chunked import chunked_cross_entropy
from vltrain.objectives.scoring import Objectives

T, W, V = 37, 24, 101


def _inputs(dtype, bias=True, ignored=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, W, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, W, generator=g, dtype=torch.float64) * W**-0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < ignored] = -100
    upstream = torch.rand(T, generator=g, dtype=torch.float64)  # row weights, as the objectives give them
    return hidden, weight, b, labels, upstream


def _leaves(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


def _reference(hidden, weight, bias, labels, upstream, smoothing):
    """F.cross_entropy over the whole logits tensor, in at least fp32 (the unchunked caption path)."""
    up = lambda t: None if t is None else (t if t.dtype == torch.float64 else t.float())  # noqa: E731
    logits = F.linear(up(hidden), up(weight), up(bias))
    ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none", label_smoothing=smoothing)
    grads = torch.autograd.grad((ce * upstream.to(ce.dtype)).sum(), _leaves(hidden, weight, bias))
    return ce.detach(), grads


def _chunked(hidden, weight, bias, labels, upstream, smoothing, chunk):
    ce = chunked_cross_entropy(hidden, weight, bias, labels, smoothing, chunk)
    grads = torch.autograd.grad((ce * upstream.to(ce.dtype)).sum(), _leaves(hidden, weight, bias))
    return ce.detach(), grads


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 5, T, 1000], ids=["chunk1", "chunk5", "chunkT", "chunk>T"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_values_and_gradients_are_cross_entropys(dtype, chunk, smoothing, bias):
    """5 does not divide 37; a third of the labels are ignored."""
    args = _inputs(dtype, bias)
    want, want_grads = _reference(*args, smoothing)
    got, got_grads = _chunked(*args, smoothing, chunk)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    assert got.dtype == want.dtype and (got[args[3] == -100] == 0).all()
    torch.testing.assert_close(got, want, **tol)
    for g, w, leaf in zip(got_grads, want_grads, _leaves(*args[:3])):
        assert g.dtype == leaf.dtype
        torch.testing.assert_close(g, w, **tol)


def test_nothing_labelled_gives_zero_loss_and_zero_gradients():
    hidden, weight, bias, labels, upstream = _inputs(torch.float32, ignored=1.0)
    assert (labels == -100).all()
    ce = chunked_cross_entropy(hidden, weight, bias, labels, 0.1, 8)
    (ce * upstream.float()).sum().backward()
    assert torch.equal(ce, torch.zeros(T))
    for leaf in (hidden, weight, bias):  # zeros, not None: the parameters stay in the graph
        assert leaf.grad is not None and torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_bf16_inputs_give_fp32_losses_and_bf16_gradients():
    args = _inputs(torch.bfloat16)
    fp32 = [t.detach().float().requires_grad_() for t in args[:3]]
    want, want_grads = _reference(*fp32, *args[3:], 0.1)  # the bf16 values in fp32
    got, got_grads = _chunked(*args, 0.1, 6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, rtol=4e-3, atol=1e-6)  # bf16's rounding of the fp32 gradient


def test_autocast_leaves_the_math_in_fp32():
    args = _inputs(torch.float32)
    want, want_grads = _reference(*args, 0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_grads = _chunked(*args, 0.0, 7)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# -- the caption objective ----------------------------------------------------------------------


def _task(chunk: int, head: str = "linear", seed: int = 0) -> Task:
    """tiny-coca at the model kit's sizes; ``transform``: BERT's head, tied, with its per-token bias (BLIP's)."""
    arch = tiny_coca()
    if head == "transform":
        arch.decoder = DecoderConfig(depth=1, heads=4, tied=True, head="transform")
    loss = LossConfig(itc=0, siglip=1, caption_chunk=chunk)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="", arch=arch.to_dict(), loss=loss), vocab_size=VOCAB, pad_id=PAD,
                        mask_id=MASK, image_size=32, max_text_length=8)
    return Task(model, Objectives(loss, model.spec))


def _train(task: Task, steps: int = 4) -> list[dict[str, float]]:
    opt = torch.optim.AdamW(task.parameters(), lr=1e-3)
    curve = []
    for step in range(steps):
        batch = make_batch(6, seed=step, has_image=[True, True, False, True, True, True],
                           has_text=[True, True, True, False, True, True], weights=True)
        out = task(Score(batch))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        curve.append({"loss": out.loss.item(), "caption": out.losses["caption"].item(),
                      **{f"row{i}": v for i, v in enumerate(out.rows["caption"].values.tolist())}})
    return curve


@pytest.mark.parametrize("head", ["linear", "transform"])
def test_training_with_chunks_follows_the_unchunked_curve(head):
    plain, chunked = _train(_task(0, head)), _train(_task(3, head))
    for a, b in zip(plain, chunked):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=2e-6, abs=1e-6), key


def _saved_shapes(task: Task, batch) -> list[tuple[int, ...]]:
    """The shapes of every tensor autograd saved for the backward of one scored batch."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task(Score(batch))
    return shapes


def test_with_chunks_no_token_by_vocabulary_tensor_is_kept_for_the_backward():
    batch = make_batch(6, seed=1)
    tokens = int(batch.attention_mask[:, 1:].sum())  # the labelled ones
    width = batch.input_ids.shape[1] - 1
    logits_like = lambda shapes: [s for s in shapes if len(s) >= 2 and s[-1] == VOCAB]  # noqa: E731
    unchunked = logits_like(_saved_shapes(_task(0), batch))
    assert (6 * width, VOCAB) in unchunked  # the log-softmax of every position
    assert logits_like(_saved_shapes(_task(4), batch)) == []
    assert tokens > 4  # more than one chunk


def test_a_negative_chunk_is_refused():
    with pytest.raises(ConfigError, match="model.loss.caption_chunk must be >= 0"):
        load_config(None, ["model.preset=tiny-coca", "model.loss.caption_chunk=-1"])
