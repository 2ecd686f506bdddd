"""Distillation from ``model.teacher``: the config's refusals, the teacher's own view of each row
(its image size, statistics and tokenizer), a live teacher through the CLI, and the same run from
embeddings ``vltrain data teacher-embed`` stored. The split and resume promises with a teacher:
``tests/train/test_global_batch.py`` (the distill case)."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from kits.pretrainedkit import make_clip, normalized
import numpy as np
from kits.multiproc import free_port
from kits.runkit import (assert_identical, assert_resumed_exactly, final_state, finish, from_checkpoint, launch, losses,
                         ok, overrides, session_shapes, start, train)

from vltrain.config.job import load_config
from vltrain.data.dataset import build_dataset
from vltrain.data.loading.collate import Collator
from vltrain.data.tokenizers import load_tokenizer
from vltrain.errors import ConfigError, DataError
from vltrain.compose.decide import decide, plan_teacher
from vltrain.train.teacher import Teacher


def hf_teacher(root: Path, seed: int = 0) -> Path:
    """A tiny random Hugging Face CLIP folder: 32 px, CLIP's statistics, its own word-level tokenizer."""
    folder = root / f"hf-clip-teacher-{seed}"
    if not (folder / "config.json").exists():
        make_clip(folder, seed=seed)
    return folder


def test_a_teacher_is_asked_for_only_with_a_loss_that_uses_it_and_a_missing_one_is_named(tmp_path):
    with pytest.raises(ConfigError, match="model.loss.distill and distill_sigmoid need a teacher: set model.teacher.path"):
        load_config(None, ["model.loss.distill=1"])
    with pytest.raises(ConfigError, match="no loss uses it: set model.loss.distill"):
        load_config(None, ["model.teacher.path=somewhere"])
    with pytest.raises(ConfigError, match="use model.loss.contrastive_impl: gather"):
        load_config(None, ["model.loss.distill=1", "model.teacher.path=x", "model.loss.contrastive_impl=ring"])
    with pytest.raises(ConfigError, match=r"model.loss.distill must be >= 0"):
        load_config(None, ["model.loss.distill=-1", "model.teacher.path=x"])
    cfg = load_config(None, ["model.loss.distill=1", f"model.teacher.path={tmp_path / 'nothing'}"])
    with pytest.raises(ConfigError, match="model.teacher: the teacher cannot be opened: model.teacher.path .*nothing "
                                          "does not exist"):
        plan_teacher(cfg)


def test_each_row_reaches_the_teacher_at_its_size_statistics_and_tokenizer(tmp_path_factory, tmp_path):
    shapes = session_shapes(tmp_path_factory)
    folder = hf_teacher(tmp_path_factory.getbasetemp())
    cfg = load_config(None, overrides(shapes, tmp_path / "run", data__image_size=48, model__loss__distill=1,
                                      model__teacher__path=folder))
    plan = decide(cfg, 1).teacher
    assert plan.cfg.data.image_size == 32 and plan.cfg.data.mean != cfg.data.mean
    teacher = Teacher(plan, torch.device("cpu"), contextlib.nullcontext)
    inputs = teacher.inputs(cfg)
    student_tok = load_tokenizer(str(shapes / "tokenizer.json"))
    dataset = build_dataset(cfg.data, "train", student_tok, tmp_path, teacher=inputs)
    samples = [dataset[i] for i in range(8)]
    texts = [dataset.sources[0].row(i).text for i in range(8)]
    for s, text in zip(samples, texts):
        if s.image is not None:
            assert tuple(s.image.shape) == (3, 48, 48) and tuple(s.teacher_image.shape) == (3, 32, 32)
        if text is not None:
            assert s.teacher_ids == teacher.tokenizer.encode(text, plan.cfg.data.max_text_length)[0]
            assert s.teacher_ids != s.input_ids
    batch = Collator.for_data(student_tok.pad_id, cfg.data, teacher=inputs)(samples)
    m = batch.to_model_inputs("cpu", cfg.data.mean, cfg.data.std, teacher=inputs)
    view = m.teacher_view
    assert view.images.pixels.shape == (8, 3, 32, 32) and m.images.pixels.shape == (8, 3, 48, 48)
    mean, std = torch.tensor(plan.cfg.data.mean), torch.tensor(plan.cfg.data.std)
    want = (batch.teacher_images.pixels.float() / 255 - mean[:, None, None]) / std[:, None, None]
    torch.testing.assert_close(view.images.pixels, want, rtol=0, atol=1e-5)
    assert bool((view.attention_mask.sum(1) > 0).eq(m.has_text).all())
    embeds = teacher.embed(m)
    assert embeds.image.shape == (8, 32) and embeds.scale.item() == pytest.approx(teacher.scale.item())
    assert torch.equal(embeds.image[~m.has_image], torch.zeros_like(embeds.image[~m.has_image]))

    broken = tmp_path / "no-unknown-token"
    shutil.copytree(folder, broken)
    spec = json.loads((broken / "tokenizer.json").read_text())
    spec["model"]["unk_token"] = "[NOT IN THE VOCABULARY]"
    (broken / "tokenizer.json").write_text(json.dumps(spec))
    cfg = load_config(None, overrides(shapes, tmp_path / "run2", data__image_size=48, model__loss__distill=1,
                                      model__teacher__path=broken))
    inputs = Teacher(decide(cfg, 1).teacher, torch.device("cpu"), contextlib.nullcontext).inputs(cfg)
    dataset = build_dataset(cfg.data, "train", student_tok, tmp_path, teacher=inputs)
    with pytest.raises(DataError, match=r"row \d+ of .*train.jsonl .*: the teacher's tokenizer .*no-unknown-token.* "
                                        "cannot read its caption"):
        for i in range(len(dataset)):
            dataset[i]


def test_a_teacher_at_native_shape_embeds_each_row_as_transformers_does(tmp_path_factory, tmp_path):
    """A SigLIP 2 (NaFlex) teacher of a square student: each image reaches it at its own shape (its patch
    budget, its grid), one per row padded to that budget, and its embeddings are transformers' own."""
    from kits.pretrainedkit import make_siglip2
    from PIL import Image

    shapes = session_shapes(tmp_path_factory)
    folder = tmp_path / "siglip2-teacher"
    hf, processor = make_siglip2(folder, max_patches=64)
    texts = ["a red circle", "a large blue square", "a small green triangle", "a blue circle", "a red square", None]
    sizes = [(48, 24), (20, 60), (64, 64), (30, 45), (100, 40), (16, 16)]
    rng = np.random.RandomState(0)
    rows = []
    for i, ((w, h), text) in enumerate(zip(sizes, texts)):
        Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append({"image": f"{i}.png", **({"text": text} if text else {})})
    rows.append({"text": "a green circle"})  # text only
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, overrides(shapes, tmp_path / "run", data__train=tmp_path / "rows.jsonl", data__image_size=48,
                                      data__shuffle="false", model__loss__distill=1, model__teacher__path=folder))
    plan = decide(cfg, 1).teacher
    assert (plan.cfg.data.resize, plan.cfg.data.max_patches, plan.cfg.data.patch_size) == ("native", 64, 8)
    teacher = Teacher(plan, torch.device("cpu"), contextlib.nullcontext)
    inputs = teacher.inputs(cfg)
    assert not inputs.data.pack_images and inputs.data.resize == "native" and cfg.data.resize == "crop"
    student_tok = load_tokenizer(str(shapes / "tokenizer.json"))
    dataset = build_dataset(cfg.data, "train", student_tok, tmp_path, teacher=inputs)
    samples = [dataset[i] for i in range(len(rows))]
    batch = Collator.for_data(student_tok.pad_id, cfg.data, teacher=inputs)(samples)
    m = batch.to_model_inputs("cpu", cfg.data.mean, cfg.data.std, teacher=inputs)
    assert m.images.pixels.shape == (7, 3, 48, 48) and m.teacher_view.images.pixels.shape == (7, 64, 3 * 8 * 8)
    grids = m.teacher_view.images.grids
    assert len(set(map(tuple, grids[:6].tolist()))) > 3 and grids[6].tolist() == [1, 1]  # shapes vary; none for text
    assert all(int(g[0] * g[1]) <= 64 for g in grids)
    embeds = teacher.embed(m)

    hf_inputs = processor(images=[Image.open(tmp_path / f"{i}.png") for i in range(6)], return_tensors="pt")
    assert hf_inputs["spatial_shapes"].tolist() == grids[:6].tolist()  # the same grid as transformers chooses
    words = [t for t in texts if t] + ["a green circle"]
    ids = [teacher.tokenizer.encode(t, 16)[0] for t in words]
    ids = torch.tensor([x + [1] * (16 - len(x)) for x in ids])
    with torch.no_grad():
        want_images = normalized(hf.get_image_features(**hf_inputs))
        want_texts = normalized(hf.get_text_features(input_ids=ids))
    np.testing.assert_allclose(embeds.image[:6].numpy(), want_images, atol=1e-5, rtol=0)
    has_text = m.has_text.numpy()
    np.testing.assert_allclose(embeds.text[has_text].numpy(), want_texts, atol=1e-5, rtol=0)
    assert torch.equal(embeds.image[6], torch.zeros_like(embeds.image[6]))
    assert torch.equal(embeds.text[5], torch.zeros_like(embeds.text[5]))


def _distil(shapes: Path, run: Path, teacher: Path, **extra):
    return train(shapes, run, nproc=1, timeout=240, data__image_size=48, train__max_steps=6, train__log_every=1,
                 model__loss__distill=1, model__loss__distill_sigmoid=0.5, model__teacher__path=teacher, **extra)


@pytest.mark.timeout(600)
def test_a_live_teacher_and_its_stored_embeddings_train_the_same_run(tmp_path_factory, tmp_path, cli):
    shapes = session_shapes(tmp_path_factory)
    teacher = hf_teacher(tmp_path_factory.getbasetemp())
    live = tmp_path / "live"
    proc = ok(_distil(shapes, live, teacher))
    assert f"teacher {teacher} (hf-clip): run live on 32 px images" in proc.stderr
    rows = [json.loads(x) for x in (live / "metrics.jsonl").read_text().splitlines() if '"loss/distill"' in x]
    assert len(rows) == 6 and all(r["loss/distill"] > 0 and r["loss/distill_sigmoid"] > 0 for r in rows)

    missing = _distil(shapes, tmp_path / "early", teacher, model__teacher__precomputed="true")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "no stored embeddings of teacher" in missing.stderr and "vltrain data teacher-embed" in missing.stderr

    made = cli("data", "teacher-embed", teacher, "--config", live / "config.yaml", "--dtype", "float32",
               "--workers", "0", "--batch-size", "16")
    assert made.returncode == 0, made.stderr
    assert "64 rows in 1 chunks; embedded 1 chunk(s) (64 rows, 0 chunk(s) done before)" in made.stdout
    again = cli("data", "teacher-embed", teacher, "--config", live / "config.yaml", "--dtype", "float32")
    assert again.returncode == 0 and "embedded 0 chunk(s) (0 rows, 1 chunk(s) done before)" in again.stdout

    stored = tmp_path / "stored"
    proc = ok(_distil(shapes, stored, teacher, model__teacher__precomputed="true"))
    assert "its embeddings stored beside the sample indexes" in proc.stderr
    a, b = losses(live), losses(stored)
    # fp32 both ways; the stored embeddings were computed in batches of 16, the live ones in the
    # step's, and a row's matmul rounding depends on its batch on some CPUs' kernels (an AMD EPYC
    # with AVX2 only: 5.4e-6 relative on these losses, exact on a Xeon with AMX)
    assert len(a) == len(b) == 6 and max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-5, (a, b)

    # a run started from the distilled one takes its model, not its teacher
    follow = load_config(None, [f"model.init={live}", f"data.train={shapes / 'train.jsonl'}", f"run.dir={tmp_path / 'f'}"])
    decided = decide(follow, 1)
    assert decided.teacher is None and decided.cfg.model.loss.distill == 0 and decided.cfg.model.teacher.path == ""

    other = hf_teacher(tmp_path_factory.getbasetemp(), seed=1)
    refused = _distil(shapes, tmp_path / "other", other, model__teacher__precomputed="true")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "it has embeddings of other teachers" in refused.stderr


@pytest.mark.timeout(600)
def test_two_ranks_under_fsdp2_with_a_sharded_teacher_stop_and_resume_bit_identically(tmp_path_factory, tmp_path):
    """The teacher is sharded like the student; text-only rows (a fifth of the shapes) reach both."""
    shapes = session_shapes(tmp_path_factory)
    knobs = {"train__parallelism": "fsdp", "data__image_size": 48, "model__loss__distill": 1,
             "model__teacher__path": hf_teacher(tmp_path_factory.getbasetemp())}
    ref = tmp_path / "ref"
    ok(train(shapes, ref, **knobs))
    run = from_checkpoint(ref, tmp_path / "run")
    resumed = ok(train(shapes, run, **knobs))
    assert_resumed_exactly(resumed, run, 4)
    assert "teacher: sharded by FSDP2 over the student's device mesh" in resumed.stderr
    assert_identical(final_state(ref), final_state(run))
    assert not any("teacher" in k for k in final_state(run))  # the teacher is not saved with the student


@pytest.mark.timeout(300)
def test_the_embedding_pass_splits_its_chunks_over_two_ranks_and_a_lost_chunk_is_made_again(tmp_path_factory,
                                                                                            tmp_path, cli):
    shapes = session_shapes(tmp_path_factory)
    teacher = hf_teacher(tmp_path_factory.getbasetemp())
    data = tmp_path / "shapes"
    data.mkdir()
    shutil.copy(shapes / "train.jsonl", data / "train.jsonl")  # its own index folder, beside the copy
    for image in {json.loads(x).get("image") for x in (data / "train.jsonl").read_text().splitlines()} - {None}:
        (data / image).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shapes / image, data / image)
    made = ok(finish(launch(["data", "teacher-embed", teacher, data / "train.jsonl", "--chunk-rows", "16",
                             "--batch-size", "8", "--workers", "0"], 2), 240))
    assert "64 rows in 4 chunks; embedded 4 chunk(s) (64 rows, 0 chunk(s) done before)" in made.stdout
    (store,) = (data / ".vltrain-index").glob("train.jsonl-*/teacher-*")
    whole = np.load(store / "image.npy").copy()
    norms = np.linalg.norm(whole.astype(np.float32), axis=1)
    assert (norms == 0).sum() == 12 and np.abs(norms[norms > 0] - 1).max() < 2e-3  # zeros: the text-only rows

    done = np.load(store / "done.npy", mmap_mode="r+")
    done[1] = False  # a chunk lost to a kill before its flag was written
    done.flush()
    image = np.load(store / "image.npy", mmap_mode="r+")
    image[16:32] = 0
    image.flush()
    again = cli("data", "teacher-embed", teacher, data / "train.jsonl", "--chunk-rows", "16", "--workers", "0")
    assert again.returncode == 0 and "embedded 1 chunk(s) (16 rows, 3 chunk(s) done before)" in again.stdout
    np.testing.assert_allclose(np.load(store / "image.npy").astype(np.float32), whole.astype(np.float32), atol=2e-3)
    other = cli("data", "teacher-embed", teacher, data / "train.jsonl", "--chunk-rows", "32")
    assert other.returncode != 0 and "chunks of 16); give the same settings to resume it" in other.stderr

    # a rank that fails stops the pass on every rank: the other is not left waiting at a collective
    broken = tmp_path / "no-unknown-token"
    shutil.copytree(teacher, broken)
    spec = json.loads((broken / "tokenizer.json").read_text())
    spec["model"]["unk_token"] = "[NOT IN THE VOCABULARY]"
    (broken / "tokenizer.json").write_text(json.dumps(spec))
    rows = [{"text": "a photo of a red dog"} for _ in range(32)]
    rows[20]["text"] = "a photo of a zebra"  # chunk 1 of 2: rank 1's
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["-m", "vltrain", "data", "teacher-embed", str(broken), str(tmp_path / "texts.jsonl"), "--chunk-rows", "16",
            "--batch-size", "8", "--workers", "0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    failed = finish(start([*torchrun, *args]), 120)
    assert failed.returncode != 0
    assert "row 20 of " in failed.stderr and "the teacher's tokenizer" in failed.stderr
