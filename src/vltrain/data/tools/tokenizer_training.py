"""Training a BPE or WordPiece tokenizer on captions (``vltrain tokenizer train``, the demo).

Trained tokenizers lowercase, reserve ``[PAD] [UNK] [CLS] [SEP] [MASK]`` as ids 0-4, and wrap every
text as ``[CLS] ... [SEP]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from vltrain.data.index.open import open_any
from vltrain.data.tokenizers import SPECIAL_TOKENS, Tokenizer
from vltrain.errors import UserError


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
    """Every present text of the given manifests / shard patterns / parquet files, in order."""
    for path in paths:
        for text in open_any(path).texts():
            if text is not None:
                yield text
