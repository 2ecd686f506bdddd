"""model.init from Hugging Face BLIP folders. BlipForConditionalGeneration: vltrain's caption logits
and captions (greedy, beam search, with a prompt) are transformers'. BlipForImageTextRetrieval: its
ITC similarities and ITM logits are, one text encoder serving both (a shared fusion). The folder's
preprocessing and tokenizer come with it; a BLIP folder vltrain cannot read is said in one line."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kits.datafiles import run_cli  # noqa: E402
from kits.pretrainedkit import TEXTS, image_file, make_blip  # noqa: E402

from vltrain.images import Images  # noqa: E402
from vltrain.errors import ConfigError, UserError  # noqa: E402
from vltrain.eval.captioning import Prompt  # noqa: E402
from vltrain.model.generate import Decoding, generate  # noqa: E402
from vltrain.model.interop.convert import OPENAI_MEAN  # noqa: E402
from vltrain.checkpoint.paths import locate  # noqa: E402
from vltrain.compose.decide import model_config  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.compose.task import Score  # noqa: E402
from vltrain.model.passes import direct  # noqa: E402
from vltrain.types import ModelInputs  # noqa: E402

CAPTIONER = "BlipForConditionalGeneration"


def load(init, *overrides):
    """The model at ``init`` through the one door, and the checkpoint as the decide pass described it."""
    decided = model_config(locate(init), list(overrides))
    opened = open_model(decided)
    return opened.model, opened.tokenizer, opened.cfg, decided.imported


def _folder(tmp_path_factory, name, **kw):
    folder = tmp_path_factory.mktemp("blip") / name
    return folder, make_blip(folder, **kw), load(folder)


@pytest.fixture(scope="module")
def captioner(tmp_path_factory):
    return _folder(tmp_path_factory, "captioner")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _folder(tmp_path_factory, "untied", tied=False)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Weights spread wide: random captions that depend on the image, some ending before max_length."""
    return _folder(tmp_path_factory, "wide", init=0.4)


def inputs(tokenizer, texts, pixels) -> ModelInputs:
    """Captions as vltrain's collator pads them ([CLS] first, as the tokenizer writes it)."""
    rows = [tokenizer.encode(t, 16)[0] for t in texts]
    ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    every = torch.ones(len(rows), dtype=torch.bool)
    return ModelInputs(images=Images(pixels), input_ids=ids, attention_mask=mask, has_image=every, has_text=every,
                       ids=torch.arange(len(rows)))


@contextmanager
def same_inputs(model, tokenizer, hf, dtype):
    """Seeded pixels and :data:`TEXTS`' batch in ``dtype``, with both models cast to it (and back to
    fp32 after), gradients off."""
    pixels = torch.randn(len(TEXTS), 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    model.to(dtype), hf.to(dtype)
    try:
        with torch.no_grad():
            yield pixels, inputs(tokenizer, TEXTS, pixels)
    finally:
        model.float(), hf.float()


def logit_gap(model, tokenizer, hf, dtype=torch.float32) -> float:
    """The largest |vltrain - transformers| of the next-token logits at every real position, on the
    same pixels and ids (transformers given [DEC] first, as its generate starts)."""
    with same_inputs(model, tokenizer, hf, dtype) as (pixels, batch):
        enc = model.encode(batch)
        ours = model.caption_logits(enc.text_tokens, batch.attention_mask, enc.image_tokens, batch.has_image)
        ids = batch.input_ids.clone()
        ids[:, 0] = hf.config.text_config.bos_token_id
        theirs = hf(pixel_values=pixels, input_ids=ids, attention_mask=batch.attention_mask).logits
    real = batch.attention_mask.bool()
    return (ours - theirs)[real].abs().max().item()


@pytest.mark.parametrize("which", ["captioner", "untied"])
def test_caption_logits_are_transformers(which, request):
    _, hf, (model, tokenizer, _, _) = request.getfixturevalue(which)
    assert model.decoder.cfg.tied == (which == "captioner")
    assert logit_gap(model, tokenizer, hf) < 1e-5


def test_the_mapping_is_exact_in_float64(wide):
    """Wide weights make fp32's rounding reach 1e-4; in float64 the two compute the same function."""
    _, hf, (model, tokenizer, _, _) = wide
    assert logit_gap(model, tokenizer, hf, torch.float64) < 1e-9


def _theirs(hf, pixels, decoding: Decoding, prompt_ids=None) -> list[list[int]]:
    """transformers' captions, each up to its first [SEP] (a row that reached max_length has none)."""
    sep = hf.config.text_config.sep_token_id
    with torch.no_grad():
        out = hf.generate(pixel_values=pixels, input_ids=prompt_ids, max_length=decoding.max_length,
                          num_beams=decoding.beam, do_sample=False)
    return [row[: row.index(sep, 1) + 1] if sep in row[1:] else row for row in out.tolist()]


@pytest.mark.parametrize("beam", [1, 3])
def test_greedy_and_beam_captions_are_transformers(wide, beam):
    _, hf, (model, tokenizer, cfg, _) = wide
    pixels = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    decoding = Decoding(12, beam=beam)
    start = Prompt.of(tokenizer, "", 16, cfg.model.architecture().text.start_id)
    assert start.ids == [hf.config.text_config.bos_token_id] and start.end_id == hf.config.text_config.sep_token_id
    with torch.no_grad():
        ours = generate(direct(model), model.image_tokens(pixels), start.ids, start.end_id, start.pad_id, decoding)
    theirs = _theirs(hf, pixels, decoding)
    assert ours == theirs
    ended = sum(row[-1] == start.end_id for row in ours)
    assert 0 < ended < len(ours) and len({tuple(r) for r in ours}) > 2  # both ways of finishing; captions differ
    # a prompt: transformers reads the processor's ids with [DEC] for [CLS] and without the last [SEP]
    prompt = Prompt.of(tokenizer, "a photo of", 16, start.ids[0])
    ids = torch.tensor([tokenizer.encode("a photo of", 16)[0]] * len(pixels))
    with torch.no_grad():
        ours = generate(direct(model), model.image_tokens(pixels), prompt.ids, prompt.end_id, prompt.pad_id, decoding)
    assert ours == _theirs(hf, pixels, decoding, ids) and all(row[:4] == prompt.ids for row in ours)


def test_the_run_takes_the_folders_preprocessing_and_trains_the_caption_loss_alone(captioner):
    folder, _, (model, tokenizer, cfg, source) = captioner
    d = cfg.data
    assert (d.image_size, d.resize, d.interpolation, d.mean, d.max_text_length) == (32, "squash", "bicubic",
                                                                                   OPENAI_MEAN, 16)
    assert d.tokenizer == str(folder / "tokenizer.json") and tokenizer.vocab_size == 21
    loss = cfg.model.loss
    assert (loss.itc, loss.siglip, loss.caption) == (0, 0, 2) and source.kind == "hf-blip"
    assert model.text.cfg.start_id == 19 and len(model.text.blocks) == 0 and len(model.decoder.blocks) == 2
    # its contrastive parts are not in the folder: they start fresh, and said so
    from vltrain.model.interop.pretrained import load_pretrained

    assert "initialized fresh (not in the checkpoint): image_proj, logit_scale, text_proj" in load_pretrained(
        model, source)
    assert load(folder, "model.loss.itc=1")[2].model.loss.itc == 1  # unless the config says otherwise


def _edited(captioner, tmp_path, change) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(captioner[0], folder)
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(architectures=["BlipForQuestionAnswering"]),
     "is a BlipForQuestionAnswering, which vltrain does not support: it reads BlipForConditionalGeneration and "
     "BlipForImageTextRetrieval"),
    (lambda c: c.update(architectures=[]), r"names no model class \(its \"architectures\" is empty\)"),
    (lambda c: c["text_config"].update(hidden_act="relu"), "text_config: hidden_act 'relu' is not one vltrain has"),
    (lambda c: c["vision_config"].update(num_attention_heads=5),
     "vision_config: hidden_size 48 is not a multiple of num_attention_heads 5"),
    (lambda c: c["text_config"].pop("num_hidden_layers"),
     r"tensor 'text_decoder.bert.encoder.layer.2.attention.self.query.weight', which 'decoder.blocks.2.attn.qkv.weight'"),
])
def test_a_folder_vltrain_cannot_read_is_said_in_one_line(captioner, tmp_path, change, message):
    """A key left out takes transformers' default (12 layers here), and the first tensor that then
    lacks is named."""
    folder = _edited(captioner, tmp_path, change)
    with pytest.raises(UserError, match=message):
        load(folder)


def test_a_tied_head_saved_apart_must_equal_the_embeddings(captioner, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _edited(captioner, tmp_path, lambda c: None)
    state = load_file(str(folder / "model.safetensors"))
    words = state["text_decoder.bert.embeddings.word_embeddings.weight"]
    state["text_decoder.cls.predictions.decoder.weight"] = words.clone()  # as older saves kept it
    save_file(state, str(folder / "model.safetensors"))
    load(folder)
    state["text_decoder.cls.predictions.decoder.weight"] = words + 1
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="'text_decoder.cls.predictions.decoder.weight' differs from "
                                        "'text_decoder.bert.embeddings.word_embeddings.weight'"):
        load(folder)


def test_vltrain_caption_of_a_blip_folder_is_transformers_caption(wide, tmp_path, capsys):
    """Through vltrain's image pipeline and its CLI, as transformers' processor and generate caption."""
    from PIL import Image

    folder, hf, (_, tokenizer, _, _) = wide
    images = [image_file(tmp_path / f"{i}.png", seed=i) for i in range(3)]
    code, out, err = run_cli(capsys, "caption", str(folder), "--images", *map(str, images), "--max-length", "10",
                             "--beam", "3")
    assert code == 0, err
    processor = transformers.BlipProcessor.from_pretrained(folder)
    pixels = processor(images=[Image.open(p) for p in images], return_tensors="pt")["pixel_values"]
    theirs = _theirs(hf, pixels, Decoding(10, beam=3))
    for image, ids in zip(images, theirs):
        line = next(line for line in out.splitlines() if str(image) in line)
        assert line.split(str(image), 1)[1].strip() == tokenizer.decode(ids).strip()


def test_a_tokenizer_that_disagrees_with_the_config_is_noted(captioner, tmp_path):
    folder = _edited(captioner, tmp_path, lambda c: c["text_config"].update(sep_token_id=4))
    notes = load(folder)[3].preprocessing.notes
    assert notes == ["tokenizer.json gives sep_token 3 where config.json says 4: the tokenizer's is used"]



RETRIEVAL = "BlipForImageTextRetrieval"


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    return _folder(tmp_path_factory, "retrieval", kind=RETRIEVAL)


def retrieval_gaps(model, tokenizer, hf, dtype=torch.float32) -> tuple[float, float]:
    """The largest |vltrain - transformers| of the ITC similarities (every image with every text) and
    of the ITM logits (each image with its text), on the same pixels and ids."""
    with same_inputs(model, tokenizer, hf, dtype) as (pixels, batch):
        enc = model.encode(batch)
        similarity = enc.image_embeds @ enc.text_embeds.T
        itm = model.itm_logits(enc.text_tokens, batch.attention_mask, enc.image_tokens)
        given = dict(input_ids=batch.input_ids, pixel_values=pixels, attention_mask=batch.attention_mask)
        theirs_similarity = hf(**given, use_itm_head=False).itm_score
        theirs_itm = hf(**given).itm_score
    return (similarity - theirs_similarity).abs().max().item(), (itm - theirs_itm).abs().max().item()


def test_retrieval_similarities_and_itm_logits_are_transformers(retrieval):
    _, hf, (model, tokenizer, _, _) = retrieval
    similarity, itm = retrieval_gaps(model, tokenizer, hf)
    assert similarity < 1e-5 and itm < 1e-5
    assert max(retrieval_gaps(model, tokenizer, hf, torch.float64)) < 1e-12


def test_one_text_encoder_serves_itc_and_itm(retrieval):
    """The fusion pass is the text tower's own layers with their cross-attention: no layers, no
    parameters of its own; the tower hands on its embedded tokens, from which that pass starts."""
    _, _, (model, tokenizer, cfg, source) = retrieval
    assert (cfg.model.loss.itc, cfg.model.loss.itm) == (1, 1) and model.fusion.cfg.shared
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("fusion.") for n in names) and "text.blocks.1.cross.kv.weight" in names
    assert "itm_head.fc.weight" in names and model.text.fuses
    from vltrain.model.interop.pretrained import load_pretrained

    assert load_pretrained(model, source) == ["initialized fresh (not in the checkpoint): logit_scale"]


def test_retrieval_trains_every_parameter_and_without_itm_leaves_the_cross_attention(retrieval, tmp_path):
    from kits.modelkit import make_batch

    from vltrain.objectives.scoring import Objectives
    from vltrain.compose.task import Task

    folder, _, (_, _, cfg, _) = retrieval
    model = load(folder)[0].train()
    task = Task(model, Objectives(cfg.model.loss, model.spec))
    batch = make_batch(4, seed=1)
    batch.input_ids = batch.input_ids % 21  # the folder's vocabulary
    out = task(Score(batch))
    assert set(out.losses) == {"itc", "itm"}
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.text.blocks[0].cross.kv.weight.grad.any()
    # ITM off: no fusion pass, so no cross-attention to train; the folder's are said to go unused
    plain, _, _, source = load(folder, "model.loss.itm=0")
    assert plain.fusion is None and plain.text.blocks[0].cross is None
    from vltrain.model.interop.pretrained import load_pretrained

    assert ("the checkpoint's itm_head.fc, text.blocks.*.cross, text.blocks.*.cross_norm not used: the objectives "
            "that train them are off") in load_pretrained(plain, source)
    with pytest.raises(ConfigError, match="set model.loss.text_mlm=0"):
        load(folder, "model.loss.text_mlm=0.5")
