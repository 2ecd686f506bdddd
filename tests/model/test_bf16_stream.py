"""Under autocast the residual stream stays bf16: every block takes and returns bf16, the norms
included (fp32 statistics inside, the input's dtype out)."""

from __future__ import annotations

import pytest
import torch

from vltrain.model import build_model
from vltrain.model.blocks import Block, CrossBlock, LayerNorm
from vltrain.model.decoder import DecoderBlock
from vltrain.model.config import ModelConfig


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("preset,layout", [("tiny-clip", "padded"), ("tiny-clip", "packed"), ("tiny-albef", "padded"),
                                          ("tiny-coca", "packed")])
def test_every_block_and_norm_takes_and_returns_bf16(device, preset, layout):
    cfg = ModelConfig(preset=preset)
    cfg.text.layout = layout
    model = build_model(cfg, vocab_size=256, pad_id=0, mask_id=1, image_size=32, max_text_length=32).to(device)
    seen: list[tuple[str, torch.dtype, torch.dtype]] = []
    for name, module in model.named_modules():
        if isinstance(module, (Block, CrossBlock, DecoderBlock, LayerNorm)):
            module.register_forward_hook(lambda m, args, out, name=name: seen.append((name, args[0].dtype, out.dtype)))
    ids = torch.randint(2, 200, (3, 16), device=device)
    mask = torch.ones(3, 16, dtype=torch.long, device=device)
    mask[1, 9:] = 0
    with torch.autocast(device, torch.bfloat16):
        image_tokens, _ = model.vision(torch.randn(3, 3, 32, 32, device=device))
        text_tokens, _ = model.text(ids, mask)
        if model.fusion is not None:
            model.fuse(text_tokens, mask, image_tokens)
        if model.decoder is not None:
            logits = model.caption_logits(text_tokens, mask, image_tokens, torch.ones(3, dtype=torch.bool, device=device))
            assert logits.dtype == torch.bfloat16
    parts = {"vision", "text"} | {p for p in ("fusion", "decoder") if getattr(model, p) is not None}
    assert {n.split(".")[0] for n, _, _ in seen} >= parts
    assert [s for s in seen if s[1:] != (torch.bfloat16, torch.bfloat16)] == []


def test_fp32_outside_autocast_is_layer_norm_itself():
    torch.manual_seed(0)
    ours, theirs = LayerNorm(8), torch.nn.LayerNorm(8)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 8)
    assert torch.equal(ours(x), theirs(x))
