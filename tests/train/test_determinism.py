"""Bit-identical at the default thread count: a one-process run uses every core (two threads on a
2-core machine), and a new process resumed from its step-4 checkpoint ends with its tensors; two
runs from scratch agree too (``test_deterministic_mode_trains_on_a_cpu``).

The ranks of the other resume tests run one thread each (the default under ``torchrun`` on 2
cores), which cannot show an operation whose sum depends on how threads split it; these runs can.
"""

from __future__ import annotations

import os

import pytest
import torch
from kits.runkit import EVERY, assert_identical, assert_resumed_exactly, final_state, from_checkpoint, ok, overrides, train

THREADS = 2


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """256 rows: batches of 32 are large enough for the threads to split the step's gathers."""
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    root = tmp_path_factory.mktemp("shapes256")
    synthesize(root, 256, 0, text_only_fraction=0.1, seed=0, image_size=32)
    train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=200)
    (root / "base.yaml").write_text("{}\n")
    return root


def _run(shapes, run, preset: str, **extra):
    return train(shapes, run, nproc=1, model__preset=preset, train__threads=THREADS, data__batch_size=32, **extra)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["tiny-clip", "tiny-albef"])
def test_a_run_and_one_resumed_from_its_checkpoint_are_bit_identical_at_two_threads(shapes, tmp_path, preset):
    first = tmp_path / "first"
    ok(_run(shapes, first, preset))
    resumed = from_checkpoint(first, tmp_path / "resumed")
    proc = ok(_run(shapes, resumed, preset))
    assert_resumed_exactly(proc, resumed, EVERY)
    assert_identical(final_state(first), final_state(resumed))


@pytest.mark.timeout(120)
def test_deterministic_mode_trains_on_a_cpu(shapes, tmp_path, monkeypatch):
    """``train.deterministic`` turns on torch's deterministic algorithms (and leaves them off when
    not asked): every op of the step has one."""
    from vltrain.config.job import load_config
    from vltrain.train.trainer import Trainer

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored after the test
    assert not torch.are_deterministic_algorithms_enabled()
    for asked in (False, True):
        trainer = Trainer(load_config(None, overrides(shapes, tmp_path / f"here-{asked}", model__preset="tiny-albef",
                                                      train__deterministic=asked, data__num_workers=0)))
        try:
            assert torch.are_deterministic_algorithms_enabled() is asked
            assert ("CUBLAS_WORKSPACE_CONFIG" in os.environ) is asked
        finally:
            trainer.close()
            torch.use_deterministic_algorithms(False)
    a, b = tmp_path / "a", tmp_path / "b"
    ok(_run(shapes, a, "tiny-albef", train__deterministic=True, train__max_steps=4))
    ok(_run(shapes, b, "tiny-albef", train__deterministic=True, train__max_steps=4))
    assert_identical(final_state(a), final_state(b))
