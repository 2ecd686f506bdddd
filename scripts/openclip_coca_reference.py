"""OpenCLIP's own CoCa, as the reference vltrain's reading and writing of it is tested against.

Run with a Python that imports open_clip (and transformers, which its ``generate`` needs); on a CPU
torch, in a throwaway venv where torchvision's two fake-op registrations (nms, qnms, in
``torchvision/_meta_registrations.py``) are guarded, since torchvision's ops link CUDA torch.

``write FOLDER`` builds a small random ``open_clip.CoCa`` (its weights perturbed, so that no bias
or norm is left at its initial value), saves it as OpenCLIP's model folder (open_clip_config.json
and open_clip_model.safetensors, which ``create_model_from_pretrained("local-dir:FOLDER")``
opens: checked before writing) and writes reference.safetensors: fixed pixels and token ids, and
OpenCLIP's image and text features, teacher-forced caption logits and greedy captions of them.
tests/model/interop/test_openclip_coca.py reads it.

``check FOLDER REFERENCE [--sot ID --eos ID]`` opens FOLDER (``vltrain export --format openclip``
of a run, say) with ``open_clip.create_model_from_pretrained`` and prints the largest difference of
each of its outputs from REFERENCE's (the same file layout, written from vltrain's side for a
trained model); it exits 1 above 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

CONFIG = {
    "embed_dim": 48,
    "quick_gelu": False,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 16, "patch_size": 8,
                   "attentional_pool": True, "attn_pooler_queries": 9, "attn_pooler_heads": 4, "output_tokens": True},
    "text_cfg": {"context_length": 12, "vocab_size": 300, "width": 48, "heads": 4, "layers": 2, "embed_cls": True,
                 "output_tokens": True},
    "multimodal_cfg": {"context_length": 12, "vocab_size": 300, "width": 48, "heads": 4, "layers": 2,
                       "attn_pooler_heads": 4},
    "custom_text": True,
}
SOT, EOS, PAD = 1, 2, 0
LENGTHS = (12, 7, 4, 2)
SEQ_LEN = 10
"""OpenCLIP's generate: at most this many tokens, the start token and a forced end token included."""


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels [4, 3, 32, 32] (already normalized) and token ids [4, 12]: start, words, end, padding."""
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(len(LENGTHS), 3, 32, 32, generator=g)
    ids = torch.full((len(LENGTHS), 12), PAD, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(3, 300, (n,), generator=g)
        ids[row, 0], ids[row, n - 1] = SOT, EOS
    return pixels, ids


@torch.no_grad()
def outputs(model, pixels: torch.Tensor, ids: torch.Tensor, sot: int = SOT, eos: int = EOS) -> dict[str, torch.Tensor]:
    model.eval()
    out = model(pixels, ids)  # teacher forcing: logits of positions 0..10 predicting 1..11
    greedy = model.generate(pixels, generation_type="top_k", top_k=1, seq_len=SEQ_LEN, min_seq_len=0,
                            sot_token_id=sot, eos_token_id=eos, pad_token_id=PAD)
    greedy = F.pad(greedy, (0, SEQ_LEN - greedy.shape[1]), value=PAD)
    return {"image_features": out["image_features"], "text_features": out["text_features"],
            "logits": out["logits"], "logit_scale": out["logit_scale"].reshape(1), "greedy": greedy}


def write(folder: Path) -> None:
    import open_clip
    from open_clip.coca_model import CoCa
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = CoCa(**{k: v for k, v in CONFIG.items() if k != "custom_text"})
    with torch.no_grad():
        # open_clip 3.3 leaves the decoder's output matrix uninitialized (torch.empty)
        torch.nn.init.normal_(model.text_decoder.text_projection, std=CONFIG["text_cfg"]["width"] ** -0.5)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": CONFIG, "preprocess_cfg": {}}, indent=2) + "\n")
    pixels, ids = inputs()
    reference = outputs(model, pixels, ids)
    reopened, _ = open_clip.create_model_from_pretrained(f"local-dir:{folder}")
    again = outputs(reopened, pixels, ids)
    assert all(torch.equal(reference[k], again[k]) for k in reference), "open_clip reads the folder differently"
    save_file({"pixels": pixels, "ids": ids, **reference}, str(folder / "reference.safetensors"))
    print(f"wrote {folder}: greedy captions {reference['greedy'].tolist()}")


def check(folder: Path, reference_file: Path, sot: int, eos: int) -> int:
    import open_clip
    from safetensors.torch import load_file

    ref = load_file(str(reference_file))
    model, _ = open_clip.create_model_from_pretrained(f"local-dir:{folder}")
    got = outputs(model, ref["pixels"], ref["ids"], sot, eos)
    real = ref["ids"][:, :-1] != PAD  # logits at padding positions read padding: not compared
    worst = 0.0
    for key, value in got.items():
        value, expected = (value[real], ref[key][real]) if key == "logits" else (value, ref[key])
        diff = (value.float() - expected.float()).abs().max().item()
        worst = max(worst, diff)
        print(f"{key:16s} max |open_clip - reference| {diff:.2e}")
    return 0 if worst < 1e-4 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("folder", type=Path)
    c = sub.add_parser("check")
    c.add_argument("folder", type=Path)
    c.add_argument("reference", type=Path)
    c.add_argument("--sot", type=int, default=SOT, help="the start token's id (open_clip's tokenizer: 49406)")
    c.add_argument("--eos", type=int, default=EOS, help="the end token's id (open_clip's tokenizer: 49407)")
    args = parser.parse_args()
    if args.command == "write":
        write(args.folder)
        return 0
    return check(args.folder, args.reference, args.sot, args.eos)


if __name__ == "__main__":
    sys.exit(main())
