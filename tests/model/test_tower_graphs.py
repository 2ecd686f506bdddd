"""Each tower traces as one graph: what ``torch.compile`` of a whole tower needs (0 graph breaks).

The text tower is traced with the padded layout, ``model.text.layout=auto``'s choice on a GPU
(packing, a CPU-only path, finds the tokens with ``nonzero``: a break by design).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from vltrain.model import build_model
from vltrain.model.config import ModelConfig


@pytest.mark.parametrize("preset", ["tiny-clip", "tiny-albef"])
def test_both_towers_trace_without_a_graph_break(preset):
    cfg = ModelConfig(preset=preset)
    cfg.text.layout = "padded"
    model = build_model(cfg, vocab_size=256, pad_id=0, mask_id=1, image_size=32, max_text_length=32)
    pixels = torch.randn(4, 3, 32, 32)
    ids = torch.randint(2, 200, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 10:] = 0  # a padded row
    dynamo.reset()
    for tower, args in ((model.vision, (pixels,)), (model.text, (ids, mask))):
        explained = dynamo.explain(tower)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
