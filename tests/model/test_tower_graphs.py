"""Each tower traces as one graph: what ``torch.compile`` of a whole tower needs (0 graph breaks);
with images at their own shape too, padded or packed, over a bounded number of compilations.

The text tower is traced with the padded layout, ``model.text.layout=auto``'s choice on a GPU
(packing, a CPU-only path, finds the tokens with ``nonzero``: a break by design).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter

from vltrain.images import Images
from vltrain.data.loading.packing import class_slots, layout
from vltrain.model import build_model
from vltrain.model.config import ModelConfig
from vltrain.model.vision import VisionConfig, VisionTransformer


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


def native_inputs(grids: list[tuple[int, int]], pack: bool, length: int = 16, patch: int = 8):
    """Patches of images with these grids, one per sequence of ``length`` or packed (the collator's layouts)."""
    counts = [r * c for r, c in grids]
    if not pack:
        return torch.randn(len(grids), length, 3 * patch * patch), {"grids": torch.tensor(grids)}
    places, segments, patch_index = layout(counts, length)
    return (torch.randn(segments.shape[0], length, 3 * patch * patch),
            {"grids": torch.tensor(grids), "segments": segments, "patch_index": patch_index,
             "slots": class_slots(places, counts, segments.shape[0])})


def random_grids(rng: torch.Generator, most: int = 16) -> list[tuple[int, int]]:
    """1 to 9 images of random grids within ``most`` patches (a quarter of the batches hold one image)."""
    count = 1 if torch.rand((), generator=rng) < 0.25 else int(torch.randint(2, 10, (), generator=rng))
    out = []
    for _ in range(count):
        rows = int(torch.randint(1, most + 1, (), generator=rng))
        out.append((rows, int(torch.randint(1, most // rows + 1, (), generator=rng))))
    return out


@pytest.mark.parametrize("pack,class_token", [(False, False), (True, False), (True, True)])
def test_a_tower_of_images_at_their_own_shape_traces_once_and_compiles_a_bounded_number_of_times(pack, class_token):
    """No graph break for any grid (the grids are data, never read on the host), and a bounded set of
    compilations: the first shapes, dynamo's dynamic graph, and one per pattern of sizes of 1 among the
    batch's images, packed sequences and class-token slots (dynamo specializes sizes 0 and 1). Once 40
    random batches have been seen, 40 more compile nothing."""
    torch.manual_seed(0)
    tower = VisionTransformer(VisionConfig(image_size=32, patch_size=8, width=64, depth=2, heads=2,
                                           pooling="cls" if class_token else "map", class_token=class_token,
                                           pre_norm=class_token, patch_bias=not class_token))
    dynamo.reset()
    pixels, kw = native_inputs([(2, 8), (4, 4), (1, 16), (3, 5)], pack)
    explained = dynamo.explain(tower)(Images(pixels, **kw))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(tower, backend=counter)
    rng = torch.Generator().manual_seed(1)
    for sweep in range(2):
        for _ in range(40):
            pixels, kw = native_inputs(random_grids(rng), pack)
            torch.testing.assert_close(compiled(Images(pixels, **kw))[1], tower(Images(pixels, **kw))[1])
        if sweep == 0:
            warm = counter.frame_count
    assert counter.frame_count == warm <= 5
    dynamo.reset()
