"""Tokenizers: load any Hugging Face ``tokenizer.json`` (:mod:`vltrain.data.tools.tokenizer_training`
trains a BPE or WordPiece one).

Trained tokenizers lowercase, reserve ``[PAD] [UNK] [CLS] [SEP] [MASK]`` as ids 0-4, and wrap
every text as ``[CLS] ... [SEP]``. Padding is never done here: the collator pads each batch to
its own longest row.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Iterable

import tokenizers

from vltrain.errors import UserError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Names the special tokens go by in tokenizers found in the wild (BERT, RoBERTa, CLIP, T5...).
PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>")
MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
CLS_NAMES = ("[CLS]", "<s>", "<|startoftext|>", "<start_of_text>", "<bos>")
EOS_NAMES = ("[SEP]", "</s>", "<|endoftext|>", "<end_of_text>", "<eos>")


def clip_clean(text: str) -> str:
    """How OpenAI's CLIP and OpenCLIP clean a caption before tokenizing: ftfy's fixes (mojibake,
    ligatures, curly quotes, full-width forms), then HTML entities unescaped twice."""
    return html.unescape(html.unescape(_ftfy().fix_text(text)))


def _ftfy():
    try:
        import ftfy
    except ImportError:
        raise UserError("data.text_clean: clip needs the ftfy package: pip install 'vltrain[openclip]' "
                        "(or ftfy), or set data.text_clean=''") from None
    return ftfy


def lower_clean(text: str) -> str:
    """Lower-cased, as transformers' Siglip2Tokenizer normalizes SigLIP 2's captions (the Gemma
    tokenizer.json of a SigLIP 2 folder keeps case; SigLIP 2 was trained on lower-cased text)."""
    return text.lower()


CLEANERS = {"": None, "clip": clip_clean, "lower": lower_clean}
"""``data.text_clean``: what each name does to a caption before the tokenizer sees it."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids the collator and the MLM head need, and the
    cleaning (``data.text_clean``) its captions get first."""

    def __init__(self, hf: tokenizers.Tokenizer, path: str = "", clean: str = ""):
        self.hf = hf
        self.path = path
        self.clean = clean
        self._clean = CLEANERS[clean]
        if clean == "clip":
            _ftfy()  # say now, not at the first caption, that it is missing
        padding = hf.padding  # a file's own padding token wins over a guess by name
        self.pad_id: int = padding["pad_id"] if padding else (self._find(PAD_NAMES) or 0)
        hf.no_padding()
        hf.no_truncation()
        self._max_length: int | None = None
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.mask_id: int | None = self._find(MASK_NAMES)
        self.cls_id: int | None = self._find(CLS_NAMES)
        self.eos_id: int | None = self._find(EOS_NAMES)

    def _find(self, names: tuple[str, ...]) -> int | None:
        return next((i for i in map(self.hf.token_to_id, names) if i is not None), None)

    def _truncate_at(self, max_length: int) -> None:
        if self._max_length != max_length:
            self.hf.enable_truncation(max_length)
            self._max_length = max_length

    def encode(self, text: str, max_length: int) -> tuple[list[int], bool]:
        """Ids with special tokens, at most ``max_length``; and whether the text was cut."""
        self._truncate_at(max_length)
        enc = self.hf.encode(self._clean(text) if self._clean else text)
        return enc.ids, bool(enc.overflowing)

    def encode_batch(self, texts: list[str], max_length: int) -> list[list[int]]:
        """Ids of many texts at once (the library's thread pool), truncated to ``max_length``."""
        self._truncate_at(max_length)
        if self._clean:
            texts = [self._clean(t) for t in texts]
        out = [e.ids for e in self.hf.encode_batch(texts)]
        # The tokenizers library turns its thread pool off in forked DataLoader workers and warns
        # about it; saying so up front keeps worker start-up quiet.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return out

    def token_lengths(self, texts: Iterable[str | None], max_length: int, chunk: int = 8192) -> list[int]:
        """Token counts incl. special tokens, capped at ``max_length``; 0 for a missing text."""
        texts = list(texts)
        lengths = [0] * len(texts)
        present = [i for i, t in enumerate(texts) if t is not None]
        for s in range(0, len(present), chunk):
            part = present[s : s + chunk]
            for i, ids in zip(part, self.encode_batch([texts[i] for i in part], max_length)):
                lengths[i] = len(ids)
        return lengths

    def lowercases(self) -> bool:
        """Whether the tokenizer's normalizer lower-cases text (CLIP's do; some SigLIP conversions not)."""
        import json

        def found(node) -> bool:
            if isinstance(node, dict):
                if node.get("type") == "Lowercase" or (node.get("type") == "BertNormalizer" and node.get("lowercase")):
                    return True
                return any(found(v) for v in node.values())
            return isinstance(node, list) and any(found(v) for v in node)

        return found(json.loads(self.hf.to_str()).get("normalizer"))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)

    def save(self, path: str | os.PathLike) -> None:
        self.hf.save(str(path))


def load_tokenizer(path: str, clean: str = "") -> Tokenizer:
    """A ``tokenizer.json`` file, or a folder holding one (e.g. a local Hugging Face model);
    ``clean``: ``data.text_clean``."""
    if not path:
        raise UserError(
            "no tokenizer given (data.tokenizer is empty): train one with "
            "`vltrain tokenizer train MANIFEST --out tok.json`, or point to a tokenizer.json"
        )
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UserError(f"tokenizer not found: {p} (give a tokenizer.json or a folder holding one)")
    try:
        hf = tokenizers.Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises a bare Exception on unreadable files
        raise UserError(f"{p}: not a tokenizers JSON file ({e})") from e
    return Tokenizer(hf, str(p), clean)
