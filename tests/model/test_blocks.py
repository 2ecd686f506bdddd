"""The CPU low-precision attention path and the patch embedding as a matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vltrain.model.blocks import attention, key_padding_mask
from vltrain.model.vision import VisionConfig, VisionTransformer


def _qkv(b=6, h=2, n=7, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g) for _ in range(3)]


def _padding(b=6, n=7):
    lengths = torch.tensor([7, 1, 3, 5, 0, 2])[:b]
    return (torch.arange(n)[None, :] < lengths[:, None]).long()


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_cpu_attention_matches_fp32_sdpa(causal):
    q, k, v = _qkv()
    mask = key_padding_mask(_padding(), causal=causal)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()  # the all-padding row attends to its first key, no NaN
    torch.testing.assert_close(got.float(), reference, atol=3e-2, rtol=3e-2)


def test_bf16_cpu_attention_gradients_match_fp32():
    q, k, v = _qkv()
    mask = key_padding_mask(_padding())
    weights = torch.randn(q.shape)
    leaves32 = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*leaves32, attn_mask=mask) * weights).sum().backward()
    leaves16 = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    (attention(*leaves16, mask).float() * weights).sum().backward()
    for a, b in zip(leaves32, leaves16):
        torch.testing.assert_close(b.grad.float(), a.grad, atol=6e-2, rtol=6e-2)


def test_masked_keys_get_no_weight():
    q, k, v = _qkv()
    mask = key_padding_mask(_padding())
    v_changed = v.clone()
    v_changed[:, :, 5:] += 100.0  # keys 5 and 6 are padding in every row but the first
    a = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    b = attention(q.bfloat16(), k.bfloat16(), v_changed.bfloat16(), mask)
    assert torch.equal(a[1:], b[1:])
    assert not torch.equal(a[0], b[0])


def test_fp32_goes_through_sdpa_exactly():
    q, k, v = _qkv()
    mask = key_padding_mask(_padding(), causal=True)
    assert torch.equal(attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_patch_embedding_equals_the_strided_convolution():
    torch.manual_seed(0)
    vit = VisionTransformer(VisionConfig(image_size=32, patch_size=8, width=24, depth=1, heads=2))
    pixels = torch.randn(3, 3, 32, 32)
    conv = vit.patch_embed(pixels).flatten(2).transpose(1, 2)
    torch.testing.assert_close(vit.embed_patches(pixels), conv, atol=1e-5, rtol=1e-5)
