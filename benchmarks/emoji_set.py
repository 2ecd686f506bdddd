"""A real image-text set that needs no internet, only npm: Google's Noto Color Emoji as 64 px PNGs
(npm's ``emoji-datasource-google``, images under Apache 2.0, metadata under MIT), each captioned
with its Unicode name from the package's ``emoji.json``: "grinning face with smiling eyes",
"waving hand: medium-dark skin tone", "flag: Japan" style names, lowercased.

Every emoji the package draws for Google is a pair, and so is each of its skin-tone variants
(named after the base emoji and its tones): about 3,700 pairs. Images are composited on white
(the PNGs are transparent around the drawing). A seeded hash of the image file holds out a tenth
for validation (retrieval); the held-out variants of a single skin tone also form a zero-shot set
of five classes (light, medium-light, medium, medium-dark and dark skin tone), whose names the
training captions use.

    npm pack emoji-datasource-google@16.0.0 && tar xzf emoji-datasource-google-16.0.0.tgz
    PYTHONPATH=src python benchmarks/emoji_set.py package data/emoji

Writes ``OUT/train.jsonl``, ``OUT/val.jsonl``, ``OUT/images/``, ``OUT/skin/`` (a folder per tone and
``templates.txt``) and ``OUT/tokenizer.json`` (trained on the training captions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from PIL import Image

TONES = {"1F3FB": "light skin tone", "1F3FC": "medium-light skin tone", "1F3FD": "medium skin tone",
         "1F3FE": "medium-dark skin tone", "1F3FF": "dark skin tone"}
HELD_OUT = 10
"""One image in this many (by a hash of its file name) is held out."""
TEMPLATES = ("{}", "an emoji with {}", "a hand: {}", "a person: {}")
VOCAB = 1024


def pairs(package: Path) -> list[tuple[str, str, str | None]]:
    """(image file, caption, skin tone or None) of every emoji drawn for Google, variants included."""
    entries = json.loads((package / "emoji.json").read_text())
    out = []
    for e in entries:
        name = (e.get("name") or e["short_name"].replace("_", " ")).lower()
        if e.get("has_img_google"):
            out.append((e["image"], name, None))
        for code, v in (e.get("skin_variations") or {}).items():
            if not v.get("has_img_google"):
                continue
            tones = [TONES[c] for c in code.split("-") if c in TONES]
            tone = tones[0] if len(set(tones)) == 1 else None
            out.append((v["image"], f"{name}: {', '.join(dict.fromkeys(tones))}", tone))
    return out


def held_out(image: str) -> bool:
    return int(hashlib.sha256(image.encode()).hexdigest(), 16) % HELD_OUT == 0


def on_white(src: Path, dst: Path) -> None:
    with Image.open(src) as im:
        rgba = im.convert("RGBA")
    canvas = Image.new("RGB", rgba.size, (255, 255, 255))
    canvas.paste(rgba, mask=rgba.getchannel("A"))
    dst.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(dst, "PNG")


def build(package: Path, out: Path) -> Path:
    """Write the set under ``out`` (kept if already there); returns the tokenizer's path."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from vltrain.data.tools.synth import write_tokenizer

    images = package / "img" / "google" / "64"
    if not (images.is_dir() and (package / "emoji.json").exists()):
        raise SystemExit(f"{package} is not an unpacked emoji-datasource-google package (no emoji.json and "
                         f"img/google/64): npm pack emoji-datasource-google@16.0.0, then tar xzf the .tgz")
    if not (out / "val.jsonl").exists():
        rows = {"train": [], "val": []}
        skin = out / "skin"
        for image, caption, tone in pairs(package):
            src = images / image
            if not src.exists():
                continue
            split = "val" if held_out(image) else "train"
            on_white(src, out / "images" / image)
            rows[split].append({"id": f"emoji-{Path(image).stem}", "image": f"images/{image}", "text": caption})
            if split == "val" and tone is not None:
                on_white(src, skin / tone / image)
        (skin / "templates.txt").write_text("".join(t + "\n" for t in TEMPLATES))
        for split, rs in rows.items():
            (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
        print(f"{len(rows['train'])} training pairs, {len(rows['val'])} held out, "
              f"{sum(1 for _ in skin.glob('*/*.png'))} held-out images of one skin tone", flush=True)
    return write_tokenizer(out, VOCAB)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("package", type=Path, help="the unpacked npm package (its folder holds emoji.json)")
    p.add_argument("out", type=Path)
    args = p.parse_args()
    print(build(args.package, args.out))


if __name__ == "__main__":
    main()
