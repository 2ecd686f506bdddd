"""Tokenizers: load any Hugging Face ``tokenizer.json``, or train a BPE / WordPiece one.

Trained tokenizers lowercase, reserve ``[PAD] [UNK] [CLS] [SEP] [MASK]`` as ids 0-4, and wrap
every text as ``[CLS] ... [SEP]``. Padding is never done here: the collator pads each batch to
its own longest row.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Iterable, Iterator

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from vltrain.data.sources.open import open_source
from vltrain.errors import UserError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Names the special tokens go by in tokenizers found in the wild (BERT, RoBERTa, CLIP, T5...).
PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>", "<|endoftext|>")
MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
CLS_NAMES = ("[CLS]", "<s>", "<|startoftext|>", "<bos>")
EOS_NAMES = ("[SEP]", "</s>", "<|endoftext|>", "<eos>")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids the collator and the MLM head need."""

    def __init__(self, hf: tokenizers.Tokenizer, path: str = ""):
        self.hf = hf
        self.path = path
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
        enc = self.hf.encode(text)
        return enc.ids, bool(enc.overflowing)

    def encode_batch(self, texts: list[str], max_length: int) -> list[list[int]]:
        """Ids of many texts at once (the library's thread pool), truncated to ``max_length``."""
        self._truncate_at(max_length)
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


def load_tokenizer(path: str) -> Tokenizer:
    """A ``tokenizer.json`` file, or a folder holding one (e.g. a local Hugging Face model)."""
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
    return Tokenizer(hf, str(p))


def _pipeline(kind: str) -> tuple[tokenizers.Tokenizer, type, dict]:
    """An untrained tokenizer of ``kind`` ('bpe' | 'wordpiece'), its trainer class and options."""
    if kind == "bpe":
        tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
        # Byte-level: every string is representable, so trained BPE never emits [UNK].
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer_cls = trainers.BpeTrainer
        extra = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
    elif kind == "wordpiece":
        tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer_cls = trainers.WordPieceTrainer
        extra = {}
    else:
        raise UserError(f"unknown tokenizer kind {kind!r}: use 'bpe' or 'wordpiece'")
    return tok, trainer_cls, extra


def train_tokenizer(
    texts: Iterable[str], out: str | os.PathLike, vocab_size: int = 4096, kind: str = "bpe",
    min_frequency: int = 2,
) -> Tokenizer:
    """Train on ``texts`` and write ``out`` (a .json file, or a folder that gets tokenizer.json)."""
    tok, trainer_cls, extra = _pipeline(kind)
    trainer = trainer_cls(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        show_progress=False, **extra,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    cls, sep = SPECIAL_TOKENS[2], SPECIAL_TOKENS[3]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    out = Path(out)
    if out.suffix != ".json":
        out = out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return Tokenizer(tok, str(out))


def source_texts(paths: list[str]) -> Iterator[str]:
    """Every present text of the given manifests / shard patterns, in order."""
    for path in paths:
        for text in open_source(path).texts():
            if text is not None:
                yield text


def train_tokenizer_cli(args: argparse.Namespace) -> int:
    """``vltrain tokenizer train SOURCES --out FILE --vocab-size N --kind bpe|wordpiece``."""
    if args.vocab_size < len(SPECIAL_TOKENS) + 1:
        raise UserError(f"--vocab-size must be more than {len(SPECIAL_TOKENS)}, got {args.vocab_size}")
    texts = list(source_texts(args.sources))
    if not texts:
        raise UserError(f"no texts found in {', '.join(args.sources)}")
    tok = train_tokenizer(texts, args.out, vocab_size=args.vocab_size, kind=args.kind)
    print(f"wrote {tok.path}: {args.kind}, vocabulary {tok.vocab_size}, trained on {len(texts)} texts")
    return 0
