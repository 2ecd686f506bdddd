"""A run from a Hugging Face CLIPModel with text longer than its context (its position table
stretched, Long-CLIP): trained on the long captions, it keeps the longer table when resumed,
reopened, exported natively, and exported as a CLIPModel that transformers reads as vltrain does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from kits.pretrainedkit import make_clip, normalized  # noqa: E402
from kits.runkit import final_state, overrides, session_shapes, train_here  # noqa: E402

from vltrain.checkpoint.manager import INITIAL_FILE  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.config.job import load_config  # noqa: E402
from vltrain.export.native import embed, export_model  # noqa: E402
from vltrain.model.interop.stretch import stretch_positions  # noqa: E402

CONTEXT, LENGTH, KEEP = 16, 40, 6
"""The tiny CLIPModel's positions, the run's data.max_text_length, and model.text.stretch_keep."""
LONG = ["a large red circle of a small blue square of a green triangle " * 3,
        "cat " * 30, "a photo of a dog", "large blue square of a green triangle of a photo of a cat " * 2]


def _run_overrides(shapes, root, **extra) -> list[str]:
    given = {"run__dir": root / "run", "train__max_steps": 3, **extra}
    return overrides(shapes, given.pop("run__dir"), model__init=root / "pretrained", data__tokenizer="''",
                     data__max_text_length=LENGTH, model__text__stretch_keep=KEEP, data__num_workers=0,
                     checkpoint__every=0, **given)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """`vltrain train` from a 16-position CLIPModel on the shapes captions, read with 40 positions."""
    from kits import forkrun

    root = tmp_path_factory.mktemp("long-text")
    original = make_clip(root / "pretrained")
    shapes = session_shapes(tmp_path_factory)
    proc = forkrun.run(["train", str(shapes / "base.yaml"), *_run_overrides(shapes, root)], timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "text positions stretched from 16 to 40" in proc.stdout
    return root / "run", original, shapes


def test_the_run_trains_the_stretched_table_on_captions_longer_than_the_context(long_run):
    run, original, shapes = long_run
    saved = load_config(run / "config.yaml")
    assert saved.data.max_text_length == LENGTH and saved.model.arch["text"]["max_length"] == LENGTH
    assert saved.model.text.stretch_keep == KEEP
    opened = open_model(run)
    lengths = [len(opened.tokenizer.encode(json.loads(line)["text"], LENGTH)[0])
               for line in open(shapes / "train.jsonl") if "text" in json.loads(line)]
    assert sum(n > CONTEXT for n in lengths) > len(lengths) // 2  # most captions use the stretched rows
    table = original.text_model.embeddings.position_embedding.weight.detach()
    initial = load_file(str(run / INITIAL_FILE))["text.pos_embed"]
    assert torch.equal(initial, stretch_positions(table, LENGTH, KEEP))  # the run started from the stretch
    trained = final_state(run)["model.text.pos_embed"]  # the checkpoint's, as resume and eval read it
    assert trained.shape == (LENGTH, table.shape[1])
    assert not torch.equal(trained[CONTEXT:], initial[CONTEXT:])  # the rows past the context were trained


def test_a_resumed_run_keeps_the_longer_table(long_run, tmp_path):
    run, _, shapes = long_run
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cfg = load_config(None, _run_overrides(shapes, run.parent, run__dir=copy, train__max_steps=4))
    trainer = train_here(cfg)
    assert trainer.restored is not None and trainer.step == 4  # resumed at step 3, from the stretched table
    assert open_model(copy).model.text.pos_embed.shape[0] == LENGTH


def test_hf_export_writes_the_longer_table_and_transformers_reads_it_as_vltrain(long_run, tmp_path):
    run, _, _ = long_run
    out = export_model(run, tmp_path / "hf", fmt="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["max_position_embeddings"] == LENGTH
    hf, info = transformers.CLIPModel.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    opened = open_model(run)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    batch = tok(LONG, return_tensors="pt", padding=True, truncation=True, max_length=LENGTH)
    assert batch["input_ids"].shape[1] == LENGTH  # the longest caption fills the stretched table
    with torch.no_grad():
        want = normalized(hf.get_text_features(**batch))
    got = embed(opened.model, opened.tokenizer, opened.cfg, [], LONG)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_native_export_reopens_with_the_longer_table(long_run, tmp_path):
    run, _, _ = long_run
    out = export_model(run, tmp_path / "native")
    reopened, opened = open_model(out), open_model(run)
    assert reopened.cfg.data.max_text_length == LENGTH and reopened.model.text.pos_embed.shape[0] == LENGTH
    np.testing.assert_allclose(embed(reopened.model, reopened.tokenizer, reopened.cfg, [], LONG),
                               embed(opened.model, opened.tokenizer, opened.cfg, [], LONG), atol=1e-6)
