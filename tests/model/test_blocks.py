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


def _bert_layer(block, x, image=None):
    """BERT's layer written out from the block's own weights: residual, then norm, per sublayer."""
    def norm(m, y):
        return F.layer_norm(y, m.normalized_shape, m.weight, m.bias, m.eps)

    def heads(y):
        return y.view(*y.shape[:2], 4, -1).transpose(1, 2)

    def attend(q, k, v):
        w = (heads(q) @ heads(k).transpose(-1, -2) / (q.shape[-1] // 4) ** 0.5).softmax(-1)
        return (w @ heads(v)).transpose(1, 2).reshape(q.shape)

    q, k, v = block.attn.qkv(x).chunk(3, dim=-1)
    x = norm(block.attn_norm, x + block.attn.out(attend(q, k, v)))
    if image is not None:
        k, v = block.cross.kv(image).chunk(2, dim=-1)
        x = norm(block.cross_norm, x + block.cross.out(attend(block.cross.q(x), k, v)))
    return norm(block.mlp_norm, x + block.mlp.proj(F.gelu(block.mlp.fc(x))))


def test_a_post_norm_block_is_berts_layer_with_and_without_the_image():
    from vltrain.model.blocks import PostNormBlock

    torch.manual_seed(0)
    block = PostNormBlock(32, 4, image_width=24)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from (1, 0)
        x, image = torch.randn(3, 5, 32), torch.randn(3, 7, 24)
        torch.testing.assert_close(block(x), _bert_layer(block, x), atol=1e-5, rtol=0)
        torch.testing.assert_close(block(x, None, image), _bert_layer(block, x, image), atol=1e-5, rtol=0)
        # a row gated off reads no image, and its cross-attention's norm still applies
        gate = torch.tensor([1.0, 0.0, 1.0])[:, None, None]
        gated = block(x, None, image, None, gate)
        torch.testing.assert_close(gated[0], _bert_layer(block, x, image)[0], atol=1e-5, rtol=0)
        alone = block(x[1:2], None, torch.randn(1, 7, 24), None, gate[1:2])
        torch.testing.assert_close(gated[1:2], alone, atol=1e-6, rtol=0)
        assert not torch.allclose(gated[1], block(x)[1], atol=1e-3)
    assert PostNormBlock(32, 4).cross is None
