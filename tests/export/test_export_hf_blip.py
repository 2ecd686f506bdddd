"""vltrain export --format hf of BLIP models: a folder transformers' BlipForConditionalGeneration (or
BlipForImageTextRetrieval) loads with every tensor in place, that captions (scores) as vltrain does,
after a fine-tune from a BLIP folder through the real trainer; a folder read and written back is the
same tensors; and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from kits.datafiles import run_cli  # noqa: E402
from kits.pretrainedkit import TEXTS, image_file, make_blip  # noqa: E402
from kits.runkit import overrides, session_shapes, train_here  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.images import Images  # noqa: E402
from vltrain.config.job import load_config  # noqa: E402
from vltrain.errors import UserError  # noqa: E402
from vltrain.export.hf_blip import check_blip  # noqa: E402
from vltrain.export.native import export_model  # noqa: E402
from vltrain.model.generate import Decoding, generate  # noqa: E402
from vltrain.model.passes import direct  # noqa: E402
from vltrain.types import revise  # noqa: E402

HEAD = "text_decoder.cls.predictions."
RETRIEVAL = "BlipForImageTextRetrieval"


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A tiny BLIP captioner after two steps of its caption loss; returns (run, original)."""
    return _fine_tune(tmp_path_factory, "ft-blip", init=0.4)


def _fine_tune(tmp_path_factory, name: str, **kw):
    """Two trainer steps from a tiny BLIP folder; returns (run, original)."""
    root = tmp_path_factory.mktemp(name)
    original = make_blip(root / "pretrained", **kw)
    cfg = load_config(None, overrides(session_shapes(tmp_path_factory), root / "run", model__init=root / "pretrained",
                                      data__tokenizer="''", data__mean="[0.4,0.5,0.6]", train__max_steps=2,
                                      data__num_workers=0, checkpoint__every=0))
    train_here(cfg)
    return root / "run", original


def _loaded(folder, kind: str = "BlipForConditionalGeneration"):
    hf, info = getattr(transformers, kind).from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


def test_the_exported_folder_is_the_fine_tuned_model_in_transformers(finetuned, tmp_path):
    run, original = finetuned
    opened = open_model(run)
    model, tokenizer = opened.model, opened.tokenizer
    out = export_model(run, tmp_path / "hf", fmt="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BlipForConditionalGeneration"] and config["model_type"] == "blip"
    assert config["text_config"]["bos_token_id"] == 19 and config["text_config"]["sep_token_id"] == 3
    hf = _loaded(out)
    saved = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(v, saved.get(k, saved.get("text_decoder.bert.embeddings.word_embeddings.weight"
                                                     if k.endswith("decoder.weight") else f"{HEAD}bias")))
               for k, v in hf.state_dict().items())  # every tensor as written (the tied head: its embeddings)
    assert any(not torch.equal(v, original.state_dict()[k]) for k, v in hf.state_dict().items())  # trained
    # the same captions (greedy, beam 3) and logits as vltrain's, on the same pixels
    pixels = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    for beam in (1, 3):
        with torch.no_grad():
            ours = generate(direct(model), model.image_tokens(pixels), [19], 3, 0, Decoding(10, beam=beam))
            theirs = hf.generate(pixel_values=pixels, max_length=10, num_beams=beam, do_sample=False).tolist()
        assert ours == [row[: row.index(3, 1) + 1] if 3 in row[1:] else row for row in theirs]
    # and the same function: in float64, where the wide weights' fp32 rounding (1e-4) does not blur it
    ids = torch.tensor([tokenizer.encode(TEXTS[0], 16)[0]] * 6)
    pixels, model, hf = pixels.double(), model.double(), hf.double()
    with torch.no_grad():
        enc = model.encode(_inputs(pixels, ids))
        logits = model.caption_logits(enc.text_tokens, torch.ones_like(ids), enc.image_tokens, torch.ones(6) > 0)
        ids[:, 0] = 19
        assert (logits - hf(pixel_values=pixels, input_ids=ids).logits).abs().max() < 1e-9


def _inputs(pixels, ids, mask=None):
    from vltrain.types import ModelInputs

    every = torch.ones(len(ids), dtype=torch.bool)
    return ModelInputs(images=Images(pixels), input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                       has_image=every, has_text=every, ids=torch.arange(len(ids)))


def test_blip_processor_reads_the_export_as_the_run_did(finetuned, tmp_path, capsys):
    run, _ = finetuned
    out = export_model(run, tmp_path / "hf", fmt="hf")
    processor = transformers.BlipProcessor.from_pretrained(out)
    assert processor.tokenizer.bos_token == "[DEC]" and list(processor.image_processor.image_mean) == [0.4, 0.5, 0.6]
    tokenizer = open_model(run).tokenizer
    assert processor.tokenizer(TEXTS)["input_ids"] == [tokenizer.encode(t, 16)[0] for t in TEXTS]
    # at the model's size: a resize rounds a pixel a level apart here and there, which wide weights would show
    images = [image_file(tmp_path / f"{i}.png", seed=i) for i in range(3)]
    code, printed, err = run_cli(capsys, "caption", str(run), "--images", *map(str, images), "--max-length", "10")
    assert code == 0, err
    hf = _loaded(out)
    with torch.no_grad():
        ids = hf.generate(**processor(images=[Image.open(p) for p in images], return_tensors="pt"), max_length=10)
    for image, text in zip(images, processor.batch_decode(ids, skip_special_tokens=True)):
        line = next(line for line in printed.splitlines() if str(image) in line)
        assert line.split(str(image), 1)[1].strip() == text.strip()


def test_a_fine_tuned_retrieval_model_scores_as_vltrain_in_transformers(tmp_path_factory, tmp_path):
    """ITC and ITM (hard negatives) for two steps, exported: transformers' similarities and ITM
    logits are vltrain's."""
    run, original = _fine_tune(tmp_path_factory, "ft-blip-itr", kind=RETRIEVAL)
    opened = open_model(run)
    model, tokenizer = opened.model, opened.tokenizer
    assert (opened.cfg.model.loss.itc, opened.cfg.model.loss.itm) == (1, 1)
    out = export_model(run, tmp_path / "hf", fmt="hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == [RETRIEVAL]
    hf = _loaded(out, RETRIEVAL)
    assert any(not torch.equal(v, original.state_dict()[k]) for k, v in hf.state_dict().items())  # trained
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    rows = [tokenizer.encode(t, 16)[0] for t in TEXTS]
    ids = torch.tensor([r + [0] * (16 - len(r)) for r in rows])
    mask = (ids != 0).long()
    with torch.no_grad():
        enc = model.encode(_inputs(pixels, ids, mask))
        similarity = enc.image_embeds @ enc.text_embeds.T
        itm = model.itm_logits(enc.text_tokens, mask, enc.image_tokens)
        given = dict(input_ids=ids, pixel_values=pixels, attention_mask=mask)
        assert (similarity - hf(**given, use_itm_head=False).itm_score).abs().max() < 1e-5
        assert (itm - hf(**given).itm_score).abs().max() < 1e-5


@pytest.mark.parametrize("kind,tied", [("BlipForConditionalGeneration", True), ("BlipForConditionalGeneration", False),
                                       (RETRIEVAL, True)])
def test_a_folder_read_and_written_back_is_the_same_tensors(tmp_path, kind, tied):
    original = make_blip(tmp_path / "in", kind=kind, tied=tied)
    out = export_model(tmp_path / "in", tmp_path / "out", fmt="hf")
    theirs, ours = original.state_dict(), _loaded(out, kind).state_dict()
    assert sorted(ours) == sorted(theirs)
    # an untied head's cls.predictions.bias is never read by transformers: written as the bias it reads
    dead = set() if tied else {f"{HEAD}bias"}
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs if k not in dead)
    assert all(torch.equal(ours[k], theirs[f"{HEAD}decoder.bias"]) for k in dead)


def test_what_blip_cannot_hold_is_refused_in_one_line(finetuned):
    run, _ = finetuned
    opened = open_model(run)
    cropped = revise(opened.cfg, data=revise(opened.cfg.data, resize="crop"))  # the decided config is frozen
    with pytest.raises(UserError, match="BLIP's image processor squashes each image to a square, and this run read "
                                        "them with data.resize crop"):
        check_blip(opened.model, opened.tokenizer, cropped, "run")
    assert opened.cfg.data.resize == "squash"
    opened.model.decoder.cfg.head = "linear"
    with pytest.raises(UserError, match="BlipForConditionalGeneration needs a captioning decoder of post-norm layers "
                                        "with BERT's LM head"):
        check_blip(opened.model, opened.tokenizer, opened.cfg, "run")



def test_a_retrieval_model_without_its_itm_head_is_refused(tmp_path):
    make_blip(tmp_path / "in", kind=RETRIEVAL)
    opened = open_model(tmp_path / "in", ["model.loss.itm=0"])
    with pytest.raises(UserError, match="BlipForImageTextRetrieval needs image-text matching by the text encoder's "
                                        "own layers .*; an ITM head"):
        check_blip(opened.model, opened.tokenizer, opened.cfg, "run")
