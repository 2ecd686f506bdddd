"""Tiny random Hugging Face CLIPModel / SiglipModel folders, made with transformers' own classes and
saved as a user would have them (config.json, model.safetensors, tokenizer.json,
preprocessor_config.json), and the helpers that compare vltrain's embeddings with transformers'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

WORDS = ["a", "red", "blue", "green", "small", "large", "circle", "square", "triangle", "photo", "of", "dog", "cat"]
TEXTS = ["a photo of a dog", "A RED circle", "large blue square of a green triangle", "cat"]
IMAGE, PATCH, POSITIONS = 32, 8, 16


def clip_tokenizer(folder: Path) -> Tokenizer:
    """CLIP's conventions: lower-cased, <|startoftext|> ... <|endoftext|>, end-of-text the highest id
    (what legacy configs' argmax pooling relies on), padded with <|endoftext|>."""
    vocab = {w: i for i, w in enumerate(["<unk>", *WORDS, "<|startoftext|>", "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    bos, eos = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)])
    tok.save(str(folder / "tokenizer.json"))
    return tok


def siglip_tokenizer(folder: Path) -> Tokenizer:
    """SigLIP's conventions: <pad> 0, </s> 1 (its padding token), text then </s>."""
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"pad_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>"}')
    return tok


def _towers(vocab: int, width: int = 64, **text) -> tuple[dict, dict]:
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=2, num_attention_heads=2)
    return ({**tower, "vocab_size": vocab, "max_position_embeddings": POSITIONS, **text},
            {**tower, "image_size": IMAGE, "patch_size": PATCH})


def make_clip(folder: Path, seed: int = 0, legacy_eos: bool = False, hidden_act: str = "quick_gelu", width: int = 64):
    """A tiny CLIPModel; ``legacy_eos``: eos_token_id 2, as configs saved before transformers#24773;
    ``width`` 128 has OpenCLIP's 64-wide heads."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = clip_tokenizer(folder)
    eos, bos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|startoftext|>")
    text, vision = _towers(tok.get_vocab_size(), width, bos_token_id=bos, eos_token_id=2 if legacy_eos else eos,
                           pad_token_id=eos, hidden_act=hidden_act)
    config = transformers.CLIPConfig(text_config=text, vision_config={**vision, "hidden_act": hidden_act},
                                     projection_dim=32)
    torch.manual_seed(seed)
    model = transformers.CLIPModel(config).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}
                                    ).save_pretrained(folder)
    return model


def make_siglip(folder: Path, seed: int = 0):
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = siglip_tokenizer(folder)
    text, vision = _towers(tok.get_vocab_size(), pad_token_id=1, bos_token_id=None, eos_token_id=1)
    config = transformers.SiglipConfig(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    model = transformers.SiglipModel(config).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    transformers.SiglipImageProcessor(size={"height": IMAGE, "width": IMAGE}).save_pretrained(folder)
    return model


def make_siglip2(folder: Path, seed: int = 0, max_patches: int = 64, grid: int = 4, write: str = "preprocessor"):
    """A tiny Siglip2Model (NaFlex): a ``grid`` x ``grid`` position table of 8-pixel patches, a budget
    of ``max_patches``. ``write``: preprocessor (preprocessor_config.json) or processor
    (processor_config.json, the image settings nested, as transformers 5's processors save)."""
    import json

    import transformers
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    tok = siglip_tokenizer(folder)
    text, vision = _towers(tok.get_vocab_size(), pad_token_id=1, bos_token_id=None, eos_token_id=1)
    vision = {k: v for k, v in vision.items() if k != "image_size"}
    config = transformers.Siglip2Config(text_config=text,
                                        vision_config={**vision, "num_patches": grid * grid, "patch_size": PATCH})
    torch.manual_seed(seed)
    model = transformers.Siglip2Model(config).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    processor = Siglip2ImageProcessorPil(patch_size=PATCH, max_num_patches=max_patches)
    processor.save_pretrained(folder)
    if write == "processor":
        settings = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").unlink()
        (folder / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    return model, processor


@torch.no_grad()
def _randomize_norms(model) -> None:
    """Layer norms start at (1, 0) and some biases at 0: random values make a swapped tensor show."""
    for name, p in model.named_parameters():
        if p.ndim == 1 or name.endswith(("logit_scale", "logit_bias")):
            p.add_(torch.randn_like(p) * 0.1)


def image_file(path: Path, seed: int = 0, size: int = IMAGE) -> Path:
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def normalized(x: torch.Tensor) -> np.ndarray:
    out = getattr(x, "pooler_output", x)  # transformers 5 returns the pooling output
    return torch.nn.functional.normalize(out, dim=-1).detach().numpy()


BLIP_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "[DEC]", "[ENC]"]
"""BLIP's vocabulary conventions, small: BERT's special ids 0-4 ([CLS] 2, [SEP] 3 here), then words,
then [DEC] (the captioner's start token, its bos_token_id) and [ENC]."""


def blip_tokenizer(folder: Path) -> Tokenizer:
    """BLIP's tokenizer, small: BERT's uncased WordPiece, [CLS] ... [SEP], [DEC] and [ENC] added."""
    from tokenizers import decoders

    vocab = {w: i for i, w in enumerate(BLIP_WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "[ENC]"])
    tok.save(str(folder / "tokenizer.json"))
    return tok


def blip_config(tied: bool = True, init: float = 0.02):
    """A tiny BlipConfig: width 32 (48 for images), 4 heads, 32-pixel images in patches of 8;
    eos_token_id 2, as the real checkpoints have it (generation ends at sep_token_id). ``init``: the
    weights' spread (transformers' 0.02; wider, random captions depend on their image and some end
    before max_length)."""
    import transformers

    vocab = {w: i for i, w in enumerate(BLIP_WORDS)}
    text = dict(vocab_size=len(BLIP_WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=POSITIONS, bos_token_id=vocab["[DEC]"],
                eos_token_id=2, pad_token_id=0, sep_token_id=vocab["[SEP]"], tie_word_embeddings=tied,
                initializer_range=init)
    vision = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE, patch_size=PATCH, initializer_range=init)
    return transformers.BlipConfig(text_config=text, vision_config=vision, image_text_hidden_size=24,
                                   tie_word_embeddings=tied, initializer_range=init)


def make_blip(folder: Path, kind: str = "BlipForConditionalGeneration", seed: int = 0, tied: bool = True,
              init: float = 0.02):
    """A tiny random BLIP model of transformers' class ``kind``, saved as a user would have it."""
    import transformers
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    blip_tokenizer(folder)
    torch.manual_seed(seed)
    model = getattr(transformers, kind)(blip_config(tied, init)).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    BlipImageProcessorPil(size={"height": IMAGE, "width": IMAGE}).save_pretrained(folder)
    return model


COCA_FIXTURE = Path(__file__).resolve().parents[1] / "model" / "interop" / "fixtures" / "openclip-coca"


def make_coca(folder: Path) -> Path:
    """OpenCLIP's small random CoCa (fixtures/openclip-coca, 12 text positions, a 300-token vocabulary)
    as a user has it: OpenCLIP's folder with the model's tokenizer.json beside it."""
    import shutil

    shutil.copytree(COCA_FIXTURE, folder, ignore=shutil.ignore_patterns("reference.safetensors"))
    words = ["<pad>", "<|startoftext|>", "<|endoftext|>", "<unk>", *(f"w{i}" for i in range(4, 300))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    return folder
