"""OpenCLIP's (and OpenAI CLIP's) tokenizer as a ``tokenizers`` tokenizer.json
(``vltrain tokenizer from-openclip``).

An OpenCLIP checkpoint never comes with a tokenizer.json: its tokenizer is a byte-level BPE whose
merges ship as ``bpe_simple_vocab_16e6.txt.gz`` inside the open_clip package (and OpenAI's CLIP).
This rebuilds it from that file, id for id: the 256 byte symbols, the same with the end-of-word
mark ``</w>``, one token per merge (the first 48,894 merges), then ``<start_of_text>`` (49406)
and ``<end_of_text>`` (49407), named as OpenCLIP names them, so that a caption holding one of
those names tokenizes as there. Text is cut into contractions, letter runs, single digits and
other symbol runs, as CLIP's tokenizer does, after whitespace is collapsed and the text
lower-cased. A caption longer than the context keeps its ``<end_of_text>``.

CLIP's tokenizer also cleans text with ``ftfy.fix_text`` and ``html.unescape`` (twice) before it
tokenizes; no ``tokenizers`` normalizer can. ``data.text_clean: clip`` does that cleaning in
vltrain's :class:`vltrain.data.tokenizers.Tokenizer` (it needs the ``ftfy`` package).
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors

from vltrain.errors import UserError

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
MERGES = 49152 - 256 - 2
"""Merges CLIP's tokenizer reads from the file: its vocabulary is 49,408 tokens in all."""
START, END = "<start_of_text>", "<end_of_text>"
PATTERN = r"""<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
"""How CLIP cuts (lower-cased) text into words before BPE."""


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte, in the order CLIP's vocabulary lists them: the bytes
    that print as themselves first (``!`` to ``~``, ``¡`` to ``¬``, ``®`` to ``ÿ``), then the others,
    each mapped past U+00FF in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return [chr(b) for b in kept] + [chr(256 + n) for n in range(len(others))]


def find_vocab() -> Path | None:
    """The merges file of an installed open_clip, found without importing it (its package imports
    torchvision)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / VOCAB_FILE
    return path if path.is_file() else None


def read_merges(path: Path) -> list[tuple[str, str]]:
    """The merges CLIP uses, from ``path`` (gzip-compressed or plain text; its first line is a header)."""
    try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it as CLIP's BPE merges ({e})") from e
    lines = text.split("\n")[1 : MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    bad = next((i for i, m in enumerate(merges) if len(m) != 2), None)
    if len(merges) < MERGES or bad is not None:
        where = f"line {bad + 2} is not two symbols" if bad is not None else f"{len(merges)} merges, not {MERGES}"
        raise UserError(f"{path}: not CLIP's BPE merges file ({VOCAB_FILE}): {where}")
    return merges  # type: ignore[return-value]


def openclip_tokenizer(vocab: str | Path | None = None) -> tokenizers.Tokenizer:
    """CLIP's tokenizer from its merges file (``vocab``; default: an installed open_clip's)."""
    path = Path(vocab) if vocab else find_vocab()
    if path is None:
        raise UserError(f"give the path of OpenCLIP's {VOCAB_FILE} (it ships inside the open_clip_torch "
                        "package, and in OpenAI's CLIP repository); open_clip is not installed here")
    if not path.is_file():
        raise UserError(f"{path} does not exist (give OpenCLIP's {VOCAB_FILE})")
    merges = read_merges(path)
    symbols = byte_symbols()
    vocab_list = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [START, END]
    ids = {token: i for i, token in enumerate(vocab_list)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=ids, merges=merges, end_of_word_suffix="</w>", unk_token=None))
    tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip(),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # bytes back to text, each end-of-word mark a space (as CLIP's decode: "a dog , it 's")
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("</w>", " "), decoders.Strip(" ", 0, 1)])
    # matched in the normalized (lower-cased) text, as CLIP's own pattern matches them
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=True) for t in (START, END)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{START} $A {END}", pair=f"{START} $A {END} $B {END}",
        special_tokens=[(START, ids[START]), (END, ids[END])],
    )
    return tok
