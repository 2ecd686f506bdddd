"""Export and embed: the exported model gives the embeddings the trainer's model gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from kits.runkit import assert_same_recall, overrides, session_shapes, train_here

from vltrain.config.job import load_config
from vltrain.errors import UserError
from vltrain.compose.opening import open_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few steps of the fusion model in this process; returns (trainer, shapes)."""
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path_factory.mktemp("export") / "run"
    cfg = load_config(None, overrides(shapes, run, model__preset="tiny-albef", train__max_steps=3,
                                      data__num_workers=0, checkpoint__every=0))
    trainer = train_here(cfg)
    return trainer, shapes


@pytest.mark.timeout(240)
def test_export_then_embed_gives_the_trainers_embeddings(trained, tmp_path, cli):
    from vltrain.data.dataset import build_dataset
    from vltrain.data.loading.collate import Collator

    trainer, shapes = trained
    out = tmp_path / "exported"
    proc = cli("export", trainer.run_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "tokenizer.json"]

    rows = [json.loads(line) for line in (shapes / "train.jsonl").read_text().splitlines()][:12]
    with_image = [i for i, r in enumerate(rows) if r.get("image")][:3]
    texts = [i for i, r in enumerate(rows) if r.get("text")][:3]
    proc = cli("embed", out, "--images", *[shapes / rows[i]["image"] for i in with_image],
               "--texts", *[rows[i]["text"] for i in texts], "--out", tmp_path / "emb.npy")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "emb.npy")
    proc = cli("embed", out, "--images", *[shapes / rows[i]["image"] for i in with_image],
               "--texts", *[rows[i]["text"] for i in texts], "--out", tmp_path / "emb.npz")
    assert proc.returncode == 0 and f"wrote {tmp_path / 'emb.npz'}:" in proc.stdout, proc.stderr
    named = np.load(tmp_path / "emb.npz")
    np.testing.assert_array_equal(np.concatenate([named["images"], named["texts"]]), got)

    # the trainer's own pipeline and model
    dataset = build_dataset(trainer.cfg.data, "train", trainer.tokenizer)
    dc = trainer.cfg.data
    collate = Collator(trainer.tokenizer.pad_id, dc.max_text_length, dc.image_size)
    model = trainer.model.eval()
    with torch.no_grad():
        b = collate([dataset[i] for i in with_image])
        images = model.encode(b.to_model_inputs("cpu", dc.mean, dc.std))
        b = collate([dataset[i] for i in texts])
        text = model.encode(b.to_model_inputs("cpu", dc.mean, dc.std))
    want = torch.cat([images.image_embeds, text.text_embeds]).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-5)

    # vltrain eval takes the exported folder, and scores it as it scores the run it came from
    args = ("train.threads=1", "eval.batch_size=16", "train.precision=fp32", "--data", shapes / "val.jsonl", "--json")
    proc = cli("eval", out, *args)
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(proc.stdout)
    proc = cli("eval", trainer.run_dir, *args)
    assert proc.returncode == 0, proc.stderr
    assert_same_recall(exported, json.loads(proc.stdout))



@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exported_weights_that_do_not_fit_are_refused(trained, tmp_path):
    from vltrain.export.native import export_model

    trainer, _ = trained
    out = export_model(trainer.run_dir, tmp_path / "exported")
    opened = open_model(out)
    assert opened.located.kind == "export"
    assert not opened.model.training and opened.cfg.data.tokenizer == str(out / "tokenizer.json")
    config = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(config.replace("embed_dim: 0", "embed_dim: 48"))
    with pytest.raises(UserError, match=r"'image_proj\.proj\.weight' has shape \[128, 128\] there but \[48, 128\] here"):
        open_model(out)
