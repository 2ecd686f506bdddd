"""The captioning decoder (tiny-coca): causal, reads no image on text-only rows, trained by the
caption objective on the rows with text; generation with and without the cache."""

from __future__ import annotations

import pytest
import torch
from kits.modelkit import MASK, PAD, VOCAB, make_batch, small_model, small_task

from vltrain.images import Images
from vltrain.errors import ConfigError, UserError
from vltrain.model import build_model
from vltrain.model.config import ModelConfig
from vltrain.model.generate import Decoding, generate
from vltrain.model.passes import direct
from vltrain.objectives.scoring import Objectives
from vltrain.compose.task import Score
from vltrain.types import Tokens

START, END = 2, 3
ALL = torch.ones(4, dtype=torch.bool)


def _logits(model, batch, has_image=None):
    enc = model.encode(batch)
    has = batch.has_image if has_image is None else has_image
    return model.caption_logits(enc.text_tokens, batch.attention_mask, enc.image_tokens, has)


def test_the_preset_builds_a_decoder_only_with_the_caption_loss_on():
    assert small_model("tiny-coca").decoder is not None
    assert small_model("tiny-coca", caption=0).decoder is None
    assert small_model("tiny-clip").decoder is None  # no preset decoder: the weight is ignored
    assert "caption" in small_model("tiny-coca").spec.heads


def test_a_position_reads_no_later_token():
    model = small_model("tiny-coca")
    batch = make_batch(4, seed=1)
    batch.attention_mask[:] = 1
    before = _logits(model, batch)
    batch.input_ids[:, 5:] = (batch.input_ids[:, 5:] + 7) % VOCAB
    after = _logits(model, batch)
    assert torch.allclose(before[:, :5], after[:, :5], atol=1e-6)
    assert not torch.allclose(before[:, 5:], after[:, 5:], atol=1e-3)


def test_a_text_only_row_reads_no_image_and_trains_none_of_the_vision_tower():
    model = small_model("tiny-coca")
    batch = make_batch(4, seed=2, has_image=[True, False, True, False])
    first = _logits(model, batch)
    batch.images = Images(torch.randn_like(batch.images.pixels))
    second = _logits(model, batch)
    assert torch.equal(first[1], second[1]) and torch.equal(first[3], second[3])
    assert not torch.allclose(first[0], second[0], atol=1e-4)
    task = small_task("tiny-coca", itc=0, siglip=1)
    text_only = make_batch(4, seed=3, has_image=[False] * 4)
    task.objectives.loss_weights = {"caption": 1.0}  # the caption loss alone
    task(Score(text_only)).loss.backward()
    vision = [p.grad for p in task.model.vision.parameters()]
    assert all(g is not None and not g.any() for g in vision)
    assert any(p.grad.any() for p in task.model.decoder.parameters())


def test_the_caption_loss_predicts_each_next_token_of_the_rows_with_text():
    task = small_task("tiny-coca")
    batch = make_batch(4, seed=4, has_image=[True, True, False, True], has_text=[True, True, True, False])
    labels = Objectives.caption_labels(batch)
    assert torch.equal(labels[0, : batch.attention_mask[0].sum() - 1], batch.input_ids[0, 1: batch.attention_mask[0].sum()])
    assert (labels[3] == -100).all()  # image-only: nothing to predict
    out = task(Score(batch))
    logits = _logits(task.model, batch)[:, :-1]
    picked = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[picked], labels[picked])
    assert torch.allclose(out.losses["caption"], expected, atol=1e-6)
    assert out.rows["caption"].applies.tolist() == [True, True, True, False]


def test_label_smoothing_raises_the_loss_of_a_confident_model():
    plain = small_task("tiny-coca")
    smooth = small_task("tiny-coca", caption_label_smoothing=0.1)
    batch = make_batch(4, seed=5)
    assert not torch.equal(plain(Score(batch)).losses["caption"], smooth(Score(batch)).losses["caption"])


def _images(model, n=4, seed=0) -> Tokens:
    with torch.no_grad():
        return model.image_tokens(make_batch(n, seed=seed).images)


@pytest.mark.parametrize("decoding", [Decoding(8), Decoding(8, beam=3), Decoding(8, top_p=0.9, seed=1)],
                         ids=["greedy", "beam3", "top-p"])
def test_generation_with_the_cache_equals_generation_without_it(decoding):
    model = small_model("tiny-coca").eval()
    tokens = _images(model)
    cached = generate(direct(model), tokens, [START], END, PAD, decoding)
    again = generate(direct(model), tokens, [START], END, PAD, decoding)
    plain = generate(direct(model), tokens, [START], END, PAD, Decoding(**{**vars(decoding), "cache": False}))
    assert cached == plain == again
    assert all(row[0] == START and 1 < len(row) <= 8 for row in cached)


def test_cached_logits_equal_recomputed_ones_at_every_position():
    model = small_model("tiny-coca").eval()
    tokens = _images(model)
    ids = torch.randint(4, VOCAB, (4, 7))
    ids[:, 0] = START
    with torch.no_grad():
        logits, cache = model.caption_start(tokens, ALL, ids[:, :3])  # a three-token prompt at once
        assert torch.allclose(logits, model.caption_next(ids[:, :3], tokens, ALL), atol=1e-5)
        for t in range(3, 7):
            logits = model.caption_step(ids[:, t: t + 1], cache)
            assert torch.allclose(logits, model.caption_next(ids[:, : t + 1], tokens, ALL), atol=1e-5)


def test_an_image_gets_the_same_caption_alone_or_in_a_batch():
    model = small_model("tiny-coca").eval()
    tokens = _images(model)
    for decoding in (Decoding(8), Decoding(8, beam=2), Decoding(8, top_p=0.8, seed=3)):
        together = generate(direct(model), tokens, [START], END, PAD, decoding, index=torch.arange(4))
        alone = [generate(direct(model), tokens[i: i + 1], [START], END, PAD, decoding, index=torch.tensor([i]))[0]
                 for i in range(4)]
        assert together == alone


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    model = small_model("tiny-coca").eval()
    tokens = _images(model)
    greedy = generate(direct(model), tokens, [START], END, PAD, Decoding(8))
    assert generate(direct(model), tokens, [START], END, PAD, Decoding(8, top_p=1e-6, seed=5)) == greedy


def test_beam_search_finds_a_caption_at_least_as_likely_as_greedy():
    """With no length normalization, the best beam's log-probability is at least greedy's."""
    model = small_model("tiny-coca").eval()
    tokens = _images(model, n=3, seed=7)
    greedy = generate(direct(model), tokens, [START], END, PAD, Decoding(6))
    beam = generate(direct(model), tokens, [START], END, PAD, Decoding(6, beam=4, length_penalty=0.0))

    def logp(row, i):
        ids = torch.tensor(row)[None]
        with torch.no_grad():
            total = 0.0
            for t in range(1, len(row)):
                lp = model.caption_next(ids[:, :t], tokens[i: i + 1], ALL[:1]).log_softmax(-1)
                total += float(lp[0, row[t]])
        return total

    assert all(logp(b, i) >= logp(g, i) - 1e-4 for i, (b, g) in enumerate(zip(beam, greedy)))


def test_bad_decoding_settings_are_refused_in_one_line():
    with pytest.raises(UserError, match="--beam must be >= 1"):
        Decoding(8, beam=0).check(1, 8)
    with pytest.raises(UserError, match="prompt takes 8 tokens .* context is 8: shorten the prompt"):
        Decoding(8).check(8, 8)
    with pytest.raises(UserError, match="prompt takes 5 tokens .* none of --max-length 5 .* \\(up to 8\\)"):
        Decoding(5).check(5, 8)
    with pytest.raises(UserError, match="--max-length 40 exceeds the model's text context of 8"):
        Decoding(40).check(1, 8)
    with pytest.raises(UserError, match="does not combine with --beam"):
        Decoding(8, beam=2, top_p=0.5).check(1, 8)


def test_a_decoder_over_a_text_tower_that_sees_ahead_is_refused():
    cfg = ModelConfig(preset="", arch=_arch(causal=False))
    with pytest.raises(ConfigError, match="needs a causal text tower"):
        build_model(cfg, vocab_size=VOCAB, pad_id=PAD, mask_id=MASK, image_size=32, max_text_length=8)


def _arch(causal: bool) -> dict:
    from vltrain.model.presets import tiny_coca

    arch = tiny_coca()
    arch.text.causal = causal
    return arch.to_dict()


def test_a_tied_decoder_reads_the_token_embedding():
    arch = _arch(causal=True)
    arch["decoder"]["tied"] = True
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="", arch=arch), vocab_size=VOCAB, pad_id=PAD, mask_id=MASK, image_size=32,
                        max_text_length=8)
    assert model.decoder.head is None
    names = [n for n, _ in model.named_parameters()]
    assert "text.token_embedding.weight" in names and not any(n.startswith("decoder.head") for n in names)
    batch = make_batch(2, seed=6)
    assert _logits(model, batch).shape == (2, 8, VOCAB)


def test_an_image_at_its_own_shape_reads_only_its_real_tokens():
    """Native shape: an image padded to a longer batch (its mask) gets the caption it gets alone,
    and its logits under the decoder's loss equal too."""
    model = small_model("tiny-coca").eval()
    p = model.vision.cfg.patch_size
    g = torch.Generator().manual_seed(0)
    grids = torch.tensor([[2, 3], [3, 3]])
    pixels = torch.randn(2, 9, 3 * p * p, generator=g)
    pixels[0, 6:] = 0  # the first image has 6 patches; the batch pads it to 9
    with torch.no_grad():
        both = model.image_tokens(Images(pixels, grids))
        alone = model.image_tokens(Images(pixels[:1, :6], grids[:1]))
    assert both.real is not None and not both.real[0].all()
    for decoding in (Decoding(8), Decoding(8, beam=3)):
        assert (generate(direct(model), both, [START], END, PAD, decoding)[0]
                == generate(direct(model), alone, [START], END, PAD, decoding)[0])
    ids = torch.randint(4, VOCAB, (1, 6))
    ids[:, 0] = START
    with torch.no_grad():
        padded = model.caption_next(ids, both[:1], ALL[:1])
        own = model.caption_next(ids, alone, ALL[:1])
    assert torch.allclose(padded, own, atol=1e-5)


def _openclip_structure(seed: int = 0):
    """A small model of OpenCLIP's CoCa structure: attentional pooler (9 queries, narrower than the
    tower), text pooled at an appended class token, decoder layers with separate cross-attention."""
    from vltrain.model.decoder import DecoderConfig
    from vltrain.model.presets import Architecture
    from vltrain.model.text import TextTowerConfig
    from vltrain.model.vision import VisionConfig

    arch = Architecture(
        VisionConfig(image_size=32, patch_size=8, width=64, depth=2, heads=4, pooling="attn_pool", pool_queries=9,
                     pool_heads=4, pool_width=48),
        TextTowerConfig(vocab_size=VOCAB, max_length=8, width=48, depth=2, heads=4, pooling="appended", causal=True),
        48, decoder=DecoderConfig(depth=2, heads=4, separate_cross=True))
    torch.manual_seed(seed)
    return build_model(ModelConfig(preset="", arch=arch.to_dict()), vocab_size=VOCAB, pad_id=PAD, mask_id=MASK,
                       image_size=32, max_text_length=8)


def test_openclips_structure_keeps_each_row_to_itself_and_text_only_rows_off_the_image():
    """What the same curve on any split of a batch rests on: a row's embeddings and caption logits
    do not depend on the other rows (the pooler, the appended class token and the decoder's image
    blocks included), and a text-only row trains no image parameter."""
    model = _openclip_structure()
    batch = make_batch(6, seed=5, has_image=[True, False, True, True, False, True],
                       has_text=[True, True, False, True, True, True])
    enc = model.encode(batch)
    logits = _logits(model, batch)
    for part in (slice(0, 3), slice(3, 6)):
        sub = make_batch(6, seed=5, has_image=[True, False, True, True, False, True],
                         has_text=[True, True, False, True, True, True])
        sub = type(sub)(**{k: None if v is None else v[part] for k, v in vars(sub).items()})
        sub_enc = model.encode(sub)
        torch.testing.assert_close(sub_enc.image_embeds, enc.image_embeds[part], atol=1e-5, rtol=0)
        torch.testing.assert_close(sub_enc.text_embeds, enc.text_embeds[part], atol=1e-5, rtol=0)
        torch.testing.assert_close(_logits(model, sub), logits[part], atol=1e-5, rtol=0)
    text_only = make_batch(4, seed=3, has_image=[False] * 4)
    _logits(model, text_only).square().mean().backward()
    image_side = [*model.vision.parameters(), *(p for blk in model.decoder.blocks for p in blk.image.cross.kv.parameters()),
                  *(p for blk in model.decoder.blocks for p in blk.image.norm_image.parameters())]
    assert all(p.grad is None or not p.grad.any() for p in image_side)
    assert all(p.grad is not None and p.grad.any() for p in model.decoder.blocks[0].text.parameters())


def test_openclips_structure_generates_the_same_with_and_without_the_cache():
    model = _openclip_structure().eval()
    tokens = model.image_tokens(torch.randn(3, 3, 32, 32))
    for beam in (1, 2):
        cached = generate(direct(model), tokens, [START], END, PAD, Decoding(8, beam=beam))
        recomputed = generate(direct(model), tokens, [START], END, PAD, Decoding(8, beam=beam, cache=False))
        assert cached == recomputed and all(len(row) == 8 or row[-1] == END for row in cached)


def test_masked_image_modelling_is_refused_over_an_attentional_pooler():
    from vltrain.model.config import LossConfig
    from vltrain.model.presets import PRESETS

    arch = PRESETS["tiny-coca"]()
    arch.vision = _openclip_structure().vision.cfg
    with pytest.raises(ConfigError, match="attentional pooler's tokens are not patches"):
        build_model(ModelConfig(preset="", arch=arch.to_dict(), loss=LossConfig(image_mim=0.3)), vocab_size=VOCAB,
                    pad_id=PAD, mask_id=MASK, image_size=32, max_text_length=8)


def _blip_structure(tied: bool = True, seed: int = 0):
    """A small model of BLIP's captioner: a ViT without a norm before its blocks, a text tower that is
    BERT's embeddings alone (an embedding norm, no layers), post-norm decoder layers and BERT's LM
    head, reading a start token of its own."""
    from vltrain.model.decoder import DecoderConfig
    from vltrain.model.presets import Architecture
    from vltrain.model.text import TextTowerConfig
    from vltrain.model.vision import VisionConfig

    arch = Architecture(
        VisionConfig(image_size=32, patch_size=8, width=48, depth=2, heads=4, pre_norm=False, patch_bias=True),
        TextTowerConfig(vocab_size=VOCAB, max_length=8, width=32, depth=0, heads=4, pooling="eos", causal=True,
                        norm_eps=1e-12, embed_norm=True, post_norm=True, start_id=VOCAB - 1),
        32, decoder=DecoderConfig(depth=2, heads=4, tied=tied, post_norm=True, head="transform", norm_eps=1e-12))
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="", arch=arch.to_dict()), vocab_size=VOCAB, pad_id=PAD, mask_id=MASK,
                        image_size=32, max_text_length=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from (1, 0)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_blips_structure_has_berts_head_and_no_final_norm(tied):
    model = _blip_structure(tied)
    head = model.decoder.head
    assert model.decoder.norm is None and model.text.norm is None and len(model.text.blocks) == 0
    assert (head.decoder is None) == tied
    names = {n for n, _ in model.named_parameters()}
    assert {"decoder.head.dense.weight", "decoder.head.norm.weight", "decoder.head.bias"} <= names
    assert ("decoder.head.decoder.weight" in names) != tied
    x = torch.randn(2, 5, 32)
    weight = model.text.token_embedding.weight if tied else head.decoder.weight
    h = torch.nn.functional.layer_norm(torch.nn.functional.gelu(head.dense(x)), (32,), head.norm.weight,
                                       head.norm.bias, 1e-12)
    torch.testing.assert_close(model.decoder.logits(x), h @ weight.T + head.bias, atol=1e-5, rtol=0)


def test_blips_structure_reads_its_start_token_and_no_image_on_text_only_rows():
    model = _blip_structure()
    batch = make_batch(4, seed=2, has_image=[True, False, True, False])
    first = _logits(model, batch)
    batch.input_ids[:, 0] = 7  # whatever the tokenizer put first, the tower reads its start token
    assert torch.equal(_logits(model, batch), first)
    batch.images = Images(torch.randn_like(batch.images.pixels))
    second = _logits(model, batch)
    assert torch.equal(first[1], second[1]) and not torch.allclose(first[0], second[0], atol=1e-4)
    text_only = make_batch(4, seed=3, has_image=[False] * 4)
    _logits(model, text_only).square().mean().backward()
    image_side = [*model.vision.parameters(), *(p for blk in model.decoder.blocks for p in blk.cross.kv.parameters())]
    assert all(p.grad is None or not p.grad.any() for p in image_side)
    assert all(p.grad is not None and p.grad.any() for p in model.decoder.blocks[0].attn.parameters())


def test_blips_structure_generates_the_same_with_and_without_the_cache():
    model = _blip_structure().eval()
    tokens = model.image_tokens(torch.randn(3, 3, 32, 32))
    start = model.text.cfg.start_id
    for beam in (1, 3):
        cached = generate(direct(model), tokens, [start], END, PAD, Decoding(8, beam=beam))
        recomputed = generate(direct(model), tokens, [start], END, PAD, Decoding(8, beam=beam, cache=False))
        assert cached == recomputed and all(row[0] == start and (len(row) == 8 or row[-1] == END) for row in cached)


def test_a_captioner_without_a_contrastive_objective_still_gives_every_parameter_a_gradient():
    """BLIP's captioner trains its caption loss alone: the unused projections and temperature get
    zero gradients, so DDP without find_unused_parameters and FSDP2 see every parameter."""
    task = small_task("tiny-coca", itc=0)
    assert set(task.objectives.loss_weights) == {"caption"}
    out = task(Score(make_batch(4, seed=4, has_image=[True, True, False, True])))
    assert set(out.losses) == {"caption"}
    out.loss.backward()
    missing = [n for n, p in task.model.named_parameters() if p.grad is None]
    assert not missing
    assert not task.model.logit_scale.grad.any() and not task.model.text_proj.proj.weight.grad.any()
