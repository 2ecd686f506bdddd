"""A Hugging Face encoder from a local folder as the text tower (the optional `hf` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kits.modelkit import forward_calls  # noqa: E402

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from vltrain.images import Images
from vltrain.errors import UserError  # noqa: E402
from vltrain.model import build_model, hf_tokenizer_file  # noqa: E402
from vltrain.model.config import LossConfig, ModelConfig, TextConfig  # noqa: E402
from vltrain.objectives.scoring import Objectives  # noqa: E402
from vltrain.compose.task import Score, Task  # noqa: E402
from vltrain.types import ModelInputs  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "small", "large", "circle", "square"]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A tiny BERT with random weights, saved with its own tokenizer.json, as a user would have it."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16,
    )
    transformers.BertModel(config).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _batch(folder, texts, length=8):
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for i, t in enumerate(texts):
        enc = [2] + tok.encode(t).ids[: length - 1]
        ids[i, : len(enc)] = torch.tensor(enc)
    mask = (ids != 0).long()
    n = len(texts)
    return ModelInputs(images=Images(torch.randn(n, 3, 32, 32)), input_ids=ids, attention_mask=mask,
                       has_image=torch.ones(n, dtype=torch.bool), has_text=mask.any(1), ids=torch.arange(n))


@pytest.mark.parametrize("preset", ["tiny-clip", "tiny-albef"])
def test_hf_text_tower_trains_every_parameter(bert_folder, preset):
    cfg = ModelConfig(preset=preset, text=TextConfig(hf_path=str(bert_folder)), loss=LossConfig(itm=1.0, mlm=1.0))
    model = build_model(cfg, vocab_size=len(WORDS), pad_id=0, mask_id=4, image_size=32, max_text_length=8)
    assert model.text.width == 32 and model.text.model.pooler is None
    assert all(m.p == 0 for m in model.text.modules() if isinstance(m, torch.nn.Dropout))
    batch = _batch(bert_folder, ["a red circle", "a large blue square", "small square", ""])
    out = Task(model, Objectives(cfg.loss, model.spec))(Score(batch))
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert torch.isfinite(out.loss)
    assert len(model.blocks_for_sharding()) == 3 + 2 + (1 if preset == "tiny-albef" else 0)
    assert any("embeddings" in n for n in model.no_weight_decay())
    assert model.flops_per_sample() > 0


def test_hf_text_tower_checkpointing_is_exact(bert_folder):
    cfg = ModelConfig(preset="tiny-clip", text=TextConfig(hf_path=str(bert_folder)))
    batch = _batch(bert_folder, ["a red circle", "a large blue square"])
    results, calls = [], []
    for enabled in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, vocab_size=len(WORDS), pad_id=0, mask_id=4, image_size=32, max_text_length=8)
        model.set_activation_checkpointing(enabled)
        # transformers checkpoints a layer's forward, inside the layer's hooks: count its first part
        with forward_calls(*(block.attention for block in model.text.blocks)) as counts:
            Task(model, Objectives(cfg.loss, model.spec))(Score(batch)).loss.backward()
        results.append(model.text.token_embedding.weight.grad.clone())
        calls.append(counts)
    assert calls == [[1, 1], [2, 2]]  # with checkpointing each layer is recomputed in the backward
    torch.testing.assert_close(results[0], results[1])


def test_a_built_hf_text_tower_trains_in_training_mode(bert_folder):
    cfg = ModelConfig(preset="tiny-clip", text=TextConfig(hf_path=str(bert_folder)))
    model = build_model(cfg, vocab_size=len(WORDS), pad_id=0, mask_id=4, image_size=32, max_text_length=8)
    assert model.training
    assert all(m.training for m in model.modules())  # transformers checkpoints activations only in training mode


def test_hf_path_errors_are_user_errors(tmp_path, bert_folder):
    with pytest.raises(UserError, match="config.json"):
        build_model(ModelConfig(text=TextConfig(hf_path=str(tmp_path))), vocab_size=10, pad_id=0, mask_id=None,
                    image_size=32, max_text_length=8)
    with pytest.raises(UserError, match="max_position_embeddings"):
        build_model(ModelConfig(text=TextConfig(hf_path=str(bert_folder))), vocab_size=10, pad_id=0, mask_id=None,
                    image_size=32, max_text_length=64)


def test_tokenizer_file_is_the_folders(tmp_path, bert_folder):
    assert hf_tokenizer_file(bert_folder) == bert_folder / "tokenizer.json"
    with pytest.raises(UserError, match="tokenizer.json"):
        hf_tokenizer_file(tmp_path)


def test_trainer_takes_the_encoders_tokenizer_when_none_is_given(bert_folder):
    from vltrain.config.job import load_config
    from vltrain.errors import ConfigError
    from vltrain.compose.builders import build_model_for, build_tokenizer

    cfg = load_config(None, [f"model.text.hf_path={bert_folder}", "data.image_size=32", "data.max_text_length=8"])
    tokenizer = build_tokenizer(cfg)
    model = build_model_for(cfg, tokenizer)
    assert Path(tokenizer.path) == bert_folder / "tokenizer.json"
    with pytest.raises(ConfigError, match="data.tokenizer is empty"):
        build_tokenizer(load_config(None, ["data.image_size=32"]))
