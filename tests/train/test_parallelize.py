"""What ``train.compile`` and ``train.activation_checkpointing`` do to a model (one process, CPU)."""

from __future__ import annotations

import pytest
import torch
from kits.modelkit import make_batch, small_model, small_task

from vltrain.config.job import TrainConfig
from vltrain.train.optim import build_optimizer
from vltrain.train.parallelize import compile_blocks, compile_towers, parallelize
from vltrain.compose.task import Score

CPU = torch.device("cpu")


def _towers(task):
    return [t for t in (task.model.vision, task.model.text, task.model.fusion) if t is not None]


def test_activation_checkpointing_follows_the_config():
    plain = small_task()
    parallelize(plain, TrainConfig(), CPU)
    assert not any(t.checkpointing for t in _towers(plain))
    ckpt = small_task()
    parallelize(ckpt, TrainConfig(activation_checkpointing=True), CPU)
    assert all(t.checkpointing for t in _towers(ckpt))


def test_activation_checkpointing_recomputes_blocks_in_backward():
    """A checkpointed block runs twice per step (forward, then again in the backward)."""
    model = small_task()
    wrapped = parallelize(model, TrainConfig(activation_checkpointing=True), CPU)
    calls = []
    block = model.model.vision.blocks[0]
    block.register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation may stop early
    wrapped(Score(make_batch(4))).loss.backward()
    assert len(calls) == 2


def _train(model, wrapped, steps: int) -> list[float]:
    opt = build_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1))
    losses = []
    for step in range(steps):
        # a different modality mix each step: the towers see a different number of rows
        has_image = [True] * 6 + [step % 2 == 0, False]
        has_text = [True] * 5 + [False, True, True]
        out = wrapped(Score(make_batch(8, seed=step, has_image=has_image, has_text=has_text)))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss))
    return losses


@pytest.mark.slow
@pytest.mark.timeout(600)  # inductor builds C++ kernels: 107 s alone on a 2-core AMD EPYC, over 300 s beside another test
def test_compiled_towers_train_like_eager():
    """Compiled towers (inductor; shapes that change become dynamic) give the eager loss curve
    within float tolerance."""
    torch._dynamo.reset()
    eager = small_task(seed=3)
    compiled = small_task(seed=3)
    expected = _train(eager, parallelize(eager, TrainConfig(), CPU), steps=4)
    got = _train(compiled, parallelize(compiled, TrainConfig(compile=True), CPU), steps=4)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_compile_blocks_compiles_every_block():
    model = small_model()
    compile_blocks(model, backend="eager")
    blocks = list(model.vision.blocks) + list(model.text.blocks)
    assert all(b._compiled_call_impl is not None for b in blocks)


def test_compile_towers_compiles_each_tower_whole():
    model = small_model()
    compile_towers(model, backend="eager")
    assert all(t._compiled_call_impl is not None for t in (model.vision, model.text))
    assert all(b._compiled_call_impl is None for b in model.blocks_for_sharding())  # inside, not apart


def test_train_compile_picks_towers_and_blocks_under_fsdp(monkeypatch):
    import vltrain.train.parallelize as par

    chosen = []
    monkeypatch.setattr(par, "compile_towers", lambda m: chosen.append("towers"))
    monkeypatch.setattr(par, "compile_blocks", lambda m: chosen.append("blocks"))
    parallelize(small_task(), TrainConfig(compile=True), CPU)
    parallelize(small_task(), TrainConfig(compile=True, parallelism="fsdp"), CPU)  # no group: FSDP not applied
    assert chosen == ["towers", "blocks"]


def test_the_captioning_decoder_is_checkpointed_and_compiled_like_the_towers():
    """tiny-coca: activation checkpointing recomputes the decoder's blocks in the backward with the
    same gradients, and its compiled towers and decoder (dynamo's graphs, run eagerly: the decoder
    traces, and inductor's numerics are the towers' test's) train like eager ones."""
    eager = small_task("tiny-coca", seed=4)
    checkpointed = small_task("tiny-coca", seed=4)
    wrapped = parallelize(checkpointed, TrainConfig(activation_checkpointing=True), CPU)
    assert checkpointed.model.decoder.checkpointing
    calls = []
    checkpointed.model.decoder.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    batch = make_batch(6, seed=1, has_image=[True] * 4 + [False] * 2)
    wrapped(Score(batch)).loss.backward()
    eager(Score(batch)).loss.backward()
    assert len(calls) == 2
    for (name, a), b in zip(checkpointed.model.named_parameters(), eager.model.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    torch._dynamo.reset()
    plain, compiled = small_task("tiny-coca", seed=5), small_task("tiny-coca", seed=5)
    compile_towers(compiled.model, backend="eager")
    assert compiled.model.decoder._compiled_call_impl is not None
    expected = _train(plain, parallelize(plain, TrainConfig(), CPU), steps=2)
    assert _train(compiled, compiled, steps=2) == pytest.approx(expected, rel=1e-5, abs=1e-6)
