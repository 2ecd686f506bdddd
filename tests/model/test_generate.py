"""Greedy and beam search against transformers' own ``generate`` on the same logits: a tiny random
GPT-2 scores every position, and each image is a prefix of tokens before the start token (a
different one per image), which transformers sees as part of its prompt and vltrain as the image."""

from __future__ import annotations

import pytest
import torch

from vltrain.model.generate import Decoding, generate
from vltrain.model.passes import CaptionNext
from vltrain.types import Tokens

transformers = pytest.importorskip("transformers")

VOCAB, START, END, PAD, PREFIX = 40, 1, 2, 0, 3


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  initializer_range=0.3, bos_token_id=START, eos_token_id=END, pad_token_id=PAD)
    return transformers.GPT2LMHeadModel(cfg).eval()


def ours(model, prefixes: torch.Tensor, decoding: Decoding) -> list[list[int]]:
    """vltrain's search, the prefix carried as each row's image tokens."""
    def run(computation):
        assert isinstance(computation, CaptionNext)
        image, ids = computation.image_tokens, computation.ids
        return model(torch.cat([image.values[..., 0].long(), ids], dim=1)).logits[:, -1]

    with torch.no_grad():
        return generate(run, Tokens(prefixes[..., None].float()), [START], END, PAD, decoding)


def theirs(model, prefixes: torch.Tensor, decoding: Decoding) -> list[list[int]]:
    """transformers' search on the prefix and the start token, without its cache (the same logits)."""
    prompt = torch.cat([prefixes, torch.full((len(prefixes), 1), START)], dim=1)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=decoding.beam, do_sample=False,
                             max_length=PREFIX + decoding.max_length, length_penalty=decoding.length_penalty,
                             eos_token_id=END, pad_token_id=PAD, use_cache=False)
    # up to the first end token (a row that reached max_length has none, and no padding either)
    return [row[:row.index(END, 1) + 1] if END in row[1:] else row for row in out[:, PREFIX:].tolist()]


@pytest.mark.parametrize("beam,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.0), (3, 2.0)])
def test_search_equals_transformers_generate(gpt2, beam, length_penalty):
    prefixes = torch.randint(3, VOCAB, (24, PREFIX), generator=torch.Generator().manual_seed(beam))
    decoding = Decoding(10, beam=beam, length_penalty=length_penalty, cache=False)
    mine, reference = ours(gpt2, prefixes, decoding), theirs(gpt2, prefixes, decoding)
    assert mine == reference
    # both ways of finishing are exercised, the end token and max_length (a length penalty of 2 favours
    # the long captions so much that here every image's best one runs to max_length)
    ended = sum(row[-1] == END for row in mine)
    assert ended < len(mine) and (ended > 0 or length_penalty > 1)
