"""Small models and synthetic batches shared by the model, loss and multi-process tests."""

from __future__ import annotations

import contextlib

import torch

from vltrain.model import VLModel, build_model
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.objectives.scoring import Objectives
from vltrain.compose.task import Score, Task
from vltrain.images import Images
from vltrain.types import ModelInputs

VOCAB, PAD, MASK, IMAGE, LENGTH = 50, 0, 1, 32, 8


def small_model(preset: str = "tiny-clip", seed: int = 0, **loss) -> VLModel:
    """A preset at 32 x 32 images, 8 tokens and a 50-token vocabulary: identical for a given seed."""
    torch.manual_seed(seed)
    cfg = ModelConfig(preset=preset, loss=LossConfig(**loss))
    return build_model(cfg, vocab_size=VOCAB, pad_id=PAD, mask_id=MASK, image_size=IMAGE, max_text_length=LENGTH)


def small_task(preset: str = "tiny-clip", seed: int = 0, **loss) -> Task:
    """``small_model`` with the objectives of ``loss``: ``task(Score(batch))`` scores a batch."""
    model = small_model(preset, seed, **loss)
    return Task(model, Objectives(LossConfig(**loss), model.spec))


def make_batch(n: int, seed: int = 0, has_image=None, has_text=None, ids=None, weights: bool = False) -> ModelInputs:
    """Model inputs; rows without an image hold zero pixels, rows without text hold padding only, as
    the collator makes them; ``weights``: random row weights."""
    g = torch.Generator().manual_seed(seed)
    has_image = torch.ones(n, dtype=torch.bool) if has_image is None else torch.as_tensor(has_image, dtype=torch.bool)
    has_text = torch.ones(n, dtype=torch.bool) if has_text is None else torch.as_tensor(has_text, dtype=torch.bool)
    pixels = torch.randn(n, 3, IMAGE, IMAGE, generator=g) * has_image[:, None, None, None]
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g) * has_text
    attention_mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(2, VOCAB, (n, LENGTH), generator=g) * attention_mask
    return ModelInputs(
        images=Images(pixels), input_ids=input_ids, attention_mask=attention_mask, has_image=has_image, has_text=has_text,
        ids=torch.arange(n, dtype=torch.int64) if ids is None else torch.as_tensor(ids, dtype=torch.int64),
        row_weights=torch.rand(n, generator=g) + 0.5 if weights else None,
    )


def rows(batch: ModelInputs, index) -> ModelInputs:
    """The same batch restricted to some rows (a slice or an index tensor)."""
    return ModelInputs(**{k: None if v is None else v[index] for k, v in vars(batch).items()})


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over parameters of |a - b| / |b| (norms); parameters whose gradient is zero in b must be zero in a."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in b:
        denom = b[k].norm().item()
        err = (a[k] - b[k]).norm().item()
        worst = max(worst, err / denom if denom > 0 else err)
    return worst


@contextlib.contextmanager
def forward_calls(*modules: torch.nn.Module):
    """Counts of each module's forward calls inside the block: under activation checkpointing a
    block runs twice for one forward and backward (its recomputation in the backward), once without."""
    counts = [0] * len(modules)

    def count(i):
        def hook(*_):
            counts[i] += 1
        return hook

    handles = [m.register_forward_pre_hook(count(i)) for i, m in enumerate(modules)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
