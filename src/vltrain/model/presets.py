"""Named architectures: the table ``model.preset`` chooses from (``build_model`` builds one).

Parameter counts (``count_parameters``), at the reference vocabulary / text length / image size
given in each row (the text tower's embedding and positions follow the tokenizer and data config,
so counts elsewhere differ by (vocab - ref_vocab + length - ref_length) x text width):

================  =====================================  ==========  ======  =====  ===========
preset            towers                                 ref vocab   length  image  parameters
================  =====================================  ==========  ======  =====  ===========
tiny-clip         ViT 128w/3d/4h p16, text 128w/3d/4h    1,000       32      48     1,454,977
tiny-albef        tiny-clip + 1 fusion layer, ITM        1,000       32      48     1,720,067
clip-vit-b32      ViT-B/32, text 512w/12d/8h, embed 512  49,408      77      224    151,277,313
clip-vit-b16      ViT-B/16, text 512w/12d/8h, embed 512  49,408      77      224    149,620,737
clip-vit-l14      ViT-L/14, text 768w/12d/12h, embed 768 49,408      77      224    427,616,513
albef-base        ViT-B/16 + text 768w/6d + 6 fusion     30,522      30      256    208,945,155
tiny-coca         tiny-clip, causal text + 2 decoder     1,000       32      48     2,112,385
tiny-coca-itm     tiny-coca + 1 fusion layer, ITM        1,000       32      48     2,377,475
tiny-coca-lite    tiny-coca, 2 text blocks, 1 decoder    1,000       32      48     1,649,537
coca-vit-b32      OpenCLIP's coca_ViT-B-32               49,408      76      224    253,560,065
tiny-siglip2      tiny-clip, MAP pool, 1 LocCa layer     1,000       32      48     2,162,561
siglip2-vit-b16   SigLIP 2 B/16 + 6 LocCa layers         256,000     64      224    629,332,225
================  =====================================  ==========  ======  =====  ===========

The CLIP rows have exactly OpenCLIP's layer layout (pre-norm ViT with a norm before the blocks,
causal text tower with end-of-text pooling, bias-free projections, one temperature), hence exactly
its parameter counts, so results compare like with like. ``albef-base`` follows ALBEF's shape (a
12-layer ViT-B/16, a BERT-base-sized text encoder split into 6 text and 6 fusion layers, 256-d
embeddings) with pre-norm blocks throughout; its count includes the ITM head (MLM, when enabled,
adds a transform and a per-token bias: 30522 + 768 x 770 at the reference vocabulary).

The ``coca-*`` rows add a captioning decoder (with ``model.loss.caption`` > 0, the default):
``tiny-coca``'s reads the vision tower's tokens directly; ``coca-vit-b32`` is OpenCLIP's
coca_ViT-B-32 layer for layer (its attentional pooler, appended text class token and two-block
decoder layers), hence exactly its parameter count.

The ``siglip2`` rows are SigLIP 2's towers (a MAP-pooled ViT without a class token, a text tower
with a biased head, Gemma's 256k vocabulary for the B/16) with LocCa's decoder beside them: half
the text tower's depth, its own embeddings of the vocabulary plus 1,000 box tokens, tied to its
output map (:mod:`vltrain.model.locca`). Train them with ``model.loss.siglip`` > 0 and ``itc`` 0.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable

from vltrain.errors import UserError
from vltrain.model.decoder import DecoderConfig
from vltrain.model.fusion import FusionConfig
from vltrain.model.text import TextTowerConfig
from vltrain.model.vision import VisionConfig


@dataclass
class Architecture:
    vision: VisionConfig
    text: TextTowerConfig
    embed_dim: int
    fusion: FusionConfig | None = None
    image_proj: str = "linear"
    """linear | linear_bias | none (``vltrain.model.heads.Projection``)."""
    text_proj: str = "linear"
    decoder: DecoderConfig | None = None
    """The captioning decoder over the (causal) text tower's tokens: CoCa's multimodal decoder."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Architecture":
        """The inverse of ``to_dict`` (``model.arch``, which ``model.init`` fills in)."""
        parts = {"vision": VisionConfig, "text": TextTowerConfig, "fusion": FusionConfig, "decoder": DecoderConfig}
        try:
            kw = {k: (parts[k](**_numbers(parts[k], v, k)) if k in parts and v is not None else v)
                  for k, v in d.items()}
            arch = cls(**kw)
        except TypeError as e:
            known = ", ".join(f.name for f in fields(cls))
            raise UserError(f"model.arch is not an architecture ({e}); it holds {known}, and model.init fills it "
                            "in: leave it out of configs") from None
        return arch


def _numbers(part: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` of ``model.arch.WHERE`` with each number read as its field's type: YAML 1.1 reads
    ``1e-05`` (no dot) as a string, which a layer would only refuse deep in its first forward."""
    hints = typing.get_type_hints(part)
    out = dict(values)
    for key, value in values.items():
        want = hints.get(key)
        if want not in (int, float) or (isinstance(value, want) and not isinstance(value, bool)):
            continue
        try:
            number = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or (want is int and not number.is_integer()):
            raise UserError(f"model.arch.{where}.{key} expects {want.__name__}, got {value!r}; model.init fills "
                            "model.arch in: leave it out of configs")
        out[key] = want(number)
    return out


def tiny_clip() -> Architecture:
    """Learns the synthetic shapes on a laptop CPU in minutes.

    Patches of 16 on the shapes' 48 x 48 images are one patch per grid cell, so the vision tower
    works on 10 tokens and the text tower, which reads ~30-token captions, takes most of the work.
    """
    return Architecture(
        VisionConfig(image_size=48, patch_size=16, width=128, depth=3, heads=4),
        TextTowerConfig(width=128, depth=3, heads=4, pooling="mean"),
        embed_dim=128,
    )


def tiny_albef() -> Architecture:
    arch = tiny_clip()
    arch.fusion = FusionConfig(depth=1, heads=4)
    return arch


def _openclip_text(width: int, heads: int) -> TextTowerConfig:
    return TextTowerConfig(width=width, depth=12, heads=heads, pooling="eos", causal=True)


def clip_vit_b32() -> Architecture:
    return Architecture(VisionConfig(patch_size=32, width=768, depth=12, heads=12), _openclip_text(512, 8), 512)


def clip_vit_b16() -> Architecture:
    return Architecture(VisionConfig(patch_size=16, width=768, depth=12, heads=12), _openclip_text(512, 8), 512)


def clip_vit_l14() -> Architecture:
    return Architecture(VisionConfig(patch_size=14, width=1024, depth=24, heads=16), _openclip_text(768, 12), 768)


def albef_base() -> Architecture:
    return Architecture(
        VisionConfig(image_size=256, patch_size=16, width=768, depth=12, heads=12),
        TextTowerConfig(width=768, depth=6, heads=12, pooling="first"),
        embed_dim=256,
        fusion=FusionConfig(depth=6, heads=12),
    )


def tiny_coca() -> Architecture:
    """tiny-clip's towers with a causal text tower pooled at its last token, and a 2-block captioning
    decoder: learns to caption the synthetic shapes on a CPU."""
    arch = tiny_clip()
    arch.text = TextTowerConfig(width=128, depth=3, heads=4, pooling="eos", causal=True)
    arch.decoder = DecoderConfig(depth=2, heads=4)
    return arch


def tiny_coca_lite() -> Architecture:
    """tiny-coca with one text block and one decoder block fewer: the text side takes most of a step
    on the synthetic shapes (about 30 tokens a caption against 9 patches an image), so this one
    trains 1.2-1.5x as many samples/s on a 2-core CPU (docs/benchmarks/demo.md#demo); the demo's model."""
    arch = tiny_coca()
    arch.text.depth, arch.decoder.depth = 2, 1
    return arch


def tiny_coca_itm() -> Architecture:
    """tiny-coca with tiny-albef's fusion layer: ITC, ITM with hard negatives and captioning, the
    three objectives BLIP trains, over one causal text tower."""
    arch = tiny_coca()
    arch.fusion = FusionConfig(depth=1, heads=4)
    return arch


def coca_vit_b32() -> Architecture:
    """OpenCLIP's coca_ViT-B-32, layer for layer (``vltrain.model.interop.openclip_coca``): ViT-B/32
    ending in a 256-query attentional pooler, a 12-block causal text tower of width 512 pooled at an
    appended class token, and 12 decoder layers of width 512 with separate cross-attention blocks."""
    vision = VisionConfig(patch_size=32, width=768, depth=12, heads=12, pooling="attn_pool", pool_queries=256,
                          pool_heads=8, pool_width=512)
    text = TextTowerConfig(max_length=76, width=512, depth=12, heads=8, pooling="appended", causal=True)
    return Architecture(vision, text, 512, decoder=DecoderConfig(depth=12, heads=8, separate_cross=True))


def _siglip2(vision: VisionConfig, text: TextTowerConfig, embed_dim: int, text_pooling: str = "last") -> Architecture:
    """SigLIP 2's layout (arXiv 2502.14786): a ViT pooled by attention (MAP) with no class token, a
    text tower pooled at its last token over captions padded to one length, the embeddings taken as
    they are on the image side, and LocCa's decoder (:mod:`vltrain.model.locca`) of half the text
    tower's depth, beside them. Train it with model.loss.siglip > 0 and itc 0."""
    vision = replace(vision, pooling="map", class_token=False, pre_norm=False, patch_bias=True, act="gelu_tanh")
    text = replace(text, pooling=text_pooling, pad_to_max_length=text_pooling == "last", act="gelu_tanh")
    return Architecture(vision, text, embed_dim, image_proj="none", text_proj="linear_bias", decoder=locca_decoder(text))


def locca_decoder(text: TextTowerConfig) -> DecoderConfig:
    """LocCa's decoder beside a text tower ``text``: half its depth, its width and heads, tied to its
    own token embedding (SigLIP 2, section 2.2)."""
    return DecoderConfig(depth=max(1, text.depth // 2), heads=text.heads, act=text.act, tied=True, standalone=True)


def tiny_siglip2() -> Architecture:
    """SigLIP 2's layout (:func:`_siglip2`) at tiny-clip's size: learns the shapes, their captions and
    their regions on a CPU. Its text tower is pooled by the mean over each caption's tokens, as
    tiny-clip's, instead of at the last of 64 padded positions: the shapes' ~30-token captions
    would double the text tower's work."""
    tiny = tiny_clip()
    return _siglip2(tiny.vision, tiny.text, 128, text_pooling="mean")


def siglip2_vit_b16() -> Architecture:
    """SigLIP 2 ViT-B/16 at 224 px (google/siglip2-base-patch16-224's towers: widths 768, 12 layers,
    64 text positions), with a 6-layer LocCa decoder."""
    return _siglip2(VisionConfig(patch_size=16, width=768, depth=12, heads=12),
                    TextTowerConfig(max_length=64, width=768, depth=12, heads=12), 768)


PRESETS: dict[str, Callable[[], Architecture]] = {
    "tiny-clip": tiny_clip,
    "tiny-albef": tiny_albef,
    "clip-vit-b32": clip_vit_b32,
    "clip-vit-b16": clip_vit_b16,
    "clip-vit-l14": clip_vit_l14,
    "albef-base": albef_base,
    "tiny-coca": tiny_coca,
    "tiny-coca-itm": tiny_coca_itm,
    "tiny-coca-lite": tiny_coca_lite,
    "coca-vit-b32": coca_vit_b32,
    "tiny-siglip2": tiny_siglip2,
    "siglip2-vit-b16": siglip2_vit_b16,
}


def list_presets() -> list[str]:
    return list(PRESETS)
