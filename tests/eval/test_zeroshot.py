"""Zero-shot classification on a toy model whose embeddings are chosen, so every figure is known."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kits.multiproc import run_world
from PIL import Image

from vltrain.data.config import DataConfig
from vltrain.data.tools.tokenizer_training import train_tokenizer
from vltrain.eval.embedding import Encoder
from vltrain.eval.zeroshot import class_embeddings, evaluate_zeroshot, open_zeroshot
from vltrain.model.passes import Encode

CLASSES = ("cat", "dog", "bird")
# (class folder, red level of the image): the toy maps red level k to class k's direction, so an
# image whose level is not its folder's class is a mistake the model makes on purpose
IMAGES = [("cat", 0), ("cat", 0), ("cat", 0), ("cat", 1),  # cat: 3 of 4
          ("dog", 1), ("dog", 1), ("dog", 2),              # dog: 2 of 3
          ("bird", 2), ("bird", 0)]                         # bird: 1 of 2
DIM = 4


class ToyTask(torch.nn.Module):
    """``task(Encode(inputs))``: an image of red level k embeds as e_k (plus a little of e_3); a
    text embeds as e_k when it holds class k's token. Other parts are not needed."""

    def __init__(self, class_tokens: list[list[int]]):
        super().__init__()
        self.class_tokens = torch.tensor(class_tokens)  # [class, forms]: with and without a space before

    def forward(self, computation):
        assert isinstance(computation, Encode)
        inputs = computation.inputs
        level = (inputs.images.pixels[:, 0].mean(dim=(1, 2)) * 255 / 100).round().long().clamp(0, DIM - 1)
        image = F.normalize(F.one_hot(level, DIM).float() + 0.1 * F.one_hot(torch.full_like(level, 3), DIM), dim=-1)
        has = (inputs.input_ids[:, :, None, None] == self.class_tokens[None, None]).any(dim=3).any(dim=1)
        text = F.normalize(F.pad(has.float(), (0, DIM - len(self.class_tokens))) + 1e-3, dim=-1)
        return SimpleNamespace(image_embeds=image * inputs.has_image[:, None],
                               text_embeds=text * inputs.has_text[:, None], image_tokens=None, text_tokens=None)


def _write_set(root, corrupt: bool = False):
    for i, (cls, level) in enumerate(IMAGES):
        (root / cls).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (level * 100, 30, 30)).save(root / cls / f"{i}.png")
    if corrupt:
        (root / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    tok_path = root.parent / "tok.json"
    tok = train_tokenizer(["a photo of a cat", "a photo of a dog", "a photo of a bird"] * 20, tok_path, vocab_size=120,
                          kind="wordpiece")
    class_tokens = [[tok.encode(c, 8)[0][1], tok.encode(f"a {c}", 8)[0][-2]] for c in CLASSES]
    return tok, class_tokens


def _evaluate(root, tok, class_tokens, rank=0, world=1, batch_size=2):
    cfg = DataConfig(image_size=16, mean=[0.0, 0.0, 0.0], std=[1.0, 1.0, 1.0], num_workers=0, max_text_length=8)
    task = open_zeroshot("toy", str(root), "", cfg, tok, rank=rank, world_size=world, batch_size=batch_size)
    assert task.classnames == ["bird", "cat", "dog"]  # folder order
    import contextlib

    return evaluate_zeroshot(Encoder(ToyTask(class_tokens), cfg, torch.device("cpu"), contextlib.nullcontext), task)


def test_exact_accuracies_on_a_toy_model_with_chosen_embeddings(tmp_path):
    tok, class_tokens = _write_set(tmp_path / "set")
    m = _evaluate(tmp_path / "set", tok, class_tokens)
    assert m["zeroshot/toy/top1"] == pytest.approx(6 / 9)
    assert m["zeroshot/toy/mean_per_class"] == pytest.approx((3 / 4 + 2 / 3 + 1 / 2) / 3)
    assert m["zeroshot/toy/top5"] == 1.0  # three classes: every image's class is among its top 5
    assert m["zeroshot/toy/num_images"] == 9 and m["zeroshot/toy/num_unreadable"] == 0


def test_a_corrupt_image_is_reported_counted_and_left_out(tmp_path, caplog):
    tok, class_tokens = _write_set(tmp_path / "set", corrupt=True)
    with caplog.at_level("WARNING", logger="vltrain"):
        m = _evaluate(tmp_path / "set", tok, class_tokens)
    assert m["zeroshot/toy/num_unreadable"] == 1 and m["zeroshot/toy/num_images"] == 9
    assert m["zeroshot/toy/top1"] == pytest.approx(6 / 9)
    assert "broken.png" in caplog.text


def test_class_embedding_is_the_normalized_mean_of_its_prompts():
    prompts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    index = torch.tensor([[0, 1], [2, 3]])
    got = class_embeddings(prompts, index)
    assert torch.allclose(got, torch.tensor([[2**-0.5, 2**-0.5], [1.0, 0.0]]))


def _rank_eval(rank, world, root, class_tokens):
    from vltrain.data.tokenizers import load_tokenizer

    return _evaluate(root, load_tokenizer(str(root.parent / "tok.json")), class_tokens, rank, world)


@pytest.mark.timeout(120)
def test_two_ranks_give_the_one_process_result(tmp_path):
    tok, class_tokens = _write_set(tmp_path / "set", corrupt=True)
    one = _evaluate(tmp_path / "set", tok, class_tokens)
    both = run_world(_rank_eval, (tmp_path / "set", class_tokens), world=2, timeout=90, tmp_dir=str(tmp_path))
    assert both[0] == both[1] == one
