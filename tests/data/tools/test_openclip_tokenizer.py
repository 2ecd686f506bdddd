"""``vltrain tokenizer from-openclip``: OpenCLIP's tokenizer as a tokenizer.json, id for id.

The reference is open_clip's own ``SimpleTokenizer``, read by file path from the installed
open_clip_torch (the Makefile installs it without its dependencies: the package itself imports
torchvision, which does not load beside this CPU torch).
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from vltrain.data.tokenizers import clip_clean, load_tokenizer
from vltrain.data.tools.openclip_tokenizer import find_vocab, openclip_tokenizer
from vltrain.errors import UserError

CONTEXT = 77

CAPTIONS = [
    "A dog on a beach", "  Two   CATS\tsleeping on a\nsofa!!  ", "it's 2024, isn't it? They'll say we'd won",
    "café naïve façade Ångström", "日本語のテキストと漢字", "مرحبا بالعالم", "emoji 🐶🏖️ and a 👩‍👩‍👧 family",
    "Tom &amp; Jerry", "&lt;b&gt;bold&lt;/b&gt; and &quot;quoted&quot; &#39;single&#39;", "double &amp;amp; escaped",
    "“curly quotes” and ‘single’ ones", "ﬁne ﬂour ligatures", "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ", "mojibake: Ã©tÃ© â€” fixed",
    "e\u0301 and a\u0308 combining", "non\u00a0breaking\u2009spaces", "zero\u200bwidth", "x" * 300,
    " ".join(["word"] * 120), "3.14159 and 1,000,000 and 42nd", "<END_OF_TEXT> and <start_of_text> in a caption",
    "<|endoftext|> is not special here", "UPPER lower MiXeD", "--- ... !!! ??? @@@ ###", "",
]


def reference():
    vocab = find_vocab()
    assert vocab is not None, "open_clip_torch is not installed: `make test` installs it (see the Makefile)"
    spec = importlib.util.spec_from_file_location("openclip_tokenizer_reference", vocab.parent / "tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SimpleTokenizer(context_length=CONTEXT)


def their_ids(tokenizer, text: str) -> list[int]:
    """open_clip's ids without its padding (zeros after the last end-of-text)."""
    row = tokenizer([text])[0].tolist()
    return row[: max(i for i, v in enumerate(row) if v == tokenizer.eot_token_id) + 1]


def random_captions(n: int, seed: int = 0) -> list[str]:
    """Mixed-script strings: Latin, accents, Cyrillic, CJK, symbols, digits, emoji, whitespace."""
    rng = random.Random(seed)
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "àéîõüçñßøåÆŒ", "абвгдежзийклмнопрст",
             "的一是不了人我在有他这中大来上", "0123456789", ".,;:!?'\"()[]{}<>/\\|-_+=*&^%$#@~`", "😀🐶🌍🚀🎉",
             " \t\n\u00a0", "’“”–—…", "&amp;&lt;&gt;&#39;"]
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from vltrain.cli.main import main

    out = tmp_path_factory.mktemp("openclip") / "tok.json"
    assert main(["tokenizer", "from-openclip", "--out", str(out)]) == 0  # the installed open_clip's vocabulary
    return out


def test_the_converted_tokenizer_gives_open_clips_ids(converted):
    ref = reference()
    tok = load_tokenizer(str(converted), clean="clip")
    assert tok.vocab_size == 49408 and (tok.cls_id, tok.eos_id) == (49406, 49407)
    corpus = CAPTIONS + random_captions(500)
    mismatched = [t for t in corpus if tok.encode(t, CONTEXT)[0] != their_ids(ref, t)]
    assert not mismatched, mismatched[:5]
    # a caption cut at the context keeps its end-of-text, as open_clip's does
    ids, cut = tok.encode(CAPTIONS[18], CONTEXT)
    assert cut and len(ids) == CONTEXT and ids[-1] == 49407
    assert tok.decode(tok.encode("a dog, it's here", CONTEXT)[0]) == ref.decode(ref.encode("a dog, it's here")).strip()


def test_without_cleaning_only_the_captions_cleaning_changes_differ(converted):
    ref = reference()
    raw = load_tokenizer(str(converted))
    corpus = CAPTIONS + random_captions(500, seed=1)
    differ = {t for t in corpus if raw.encode(t, CONTEXT)[0] != their_ids(ref, t)}
    changed = {t for t in corpus if clip_clean(t) != t}
    assert differ and differ <= changed  # HTML entities, curly quotes, ligatures, full-width forms...
    assert "Tom &amp; Jerry" in differ and "A dog on a beach" not in differ


def test_text_clean_and_the_merges_file_are_checked(tmp_path):
    from vltrain.config.job import load_config

    cfg = load_config(None, ["data.text_clean=clip"])
    assert cfg.data.text_clean == "clip"
    with pytest.raises(UserError, match="data.text_clean must be '', clip or lower"):
        load_config(None, ["data.text_clean=ftfy"])
    assert load_config(None, ["data.text_clean=lower"]).data.text_clean == "lower"
    (tmp_path / "vocab.txt").write_text("#version 0.2\na b\n")
    with pytest.raises(UserError, match="not CLIP's BPE merges"):
        openclip_tokenizer(tmp_path / "vocab.txt")
