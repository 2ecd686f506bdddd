import hashlib
import json
import random
import re
from pathlib import Path

from vltrain.data.tools import synth


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_synthesize_is_deterministic_and_complete(tmp_path):
    a = synth.synthesize(tmp_path / "a", num=300, val=50, text_only_fraction=0.2, seed=3, workers=1)
    b = synth.synthesize(tmp_path / "b", num=300, val=50, text_only_fraction=0.2, seed=3, workers=2)
    ra, rb = _rows(a["train"]), _rows(b["train"])
    assert ra == rb and len(ra) == 300
    assert len(_rows(a["val"])) == 50
    for row in ra + _rows(a["val"]):
        if "image" in row:
            ha = hashlib.sha256((tmp_path / "a" / row["image"]).read_bytes()).hexdigest()
            hb = hashlib.sha256((tmp_path / "b" / row["image"]).read_bytes()).hexdigest()
            assert ha == hb
    text_only = sum("image" not in r for r in ra)
    assert 30 <= text_only <= 90  # 20% of 300, with sampling noise
    assert all("image" in r for r in _rows(a["val"]))
    assert len({r["id"] for r in ra}) == 300


def test_other_seed_gives_other_data(tmp_path):
    a = synth.synthesize(tmp_path / "a", num=20, val=0, seed=0, workers=1)
    b = synth.synthesize(tmp_path / "b", num=20, val=0, seed=1, workers=1)
    assert [r["text"] for r in _rows(a["train"])] != [r["text"] for r in _rows(b["train"])]


def test_caption_names_every_shape():
    for i in range(200):
        rng = random.Random(i)
        shapes = synth.sample_scene(rng)
        assert 1 <= len(shapes) <= 3
        assert len({s.cell for s in shapes}) == len(shapes)
        text = synth.describe(shapes, rng)
        for s in shapes:
            assert s.color in text
            assert any(w in text for w in synth.KIND_WORDS[s.kind])
            assert any(w in text for w in synth.SIZE_WORDS[s.size])
            assert any(w in text for w in synth.CELL_WORDS[s.cell])


def test_dataset_is_not_trivial():
    assert len(synth.COLORS) >= 6 and len(synth.KINDS) >= 5 and len(synth.SIZES) >= 2
    assert len(synth.CELL_WORDS) == 9
    rng = random.Random(0)
    scenes = [synth.sample_scene(rng) for _ in range(500)]
    assert {len(s) for s in scenes} == {1, 2, 3}
    captions = {synth.describe(s, random.Random(k)) for k, s in enumerate(scenes)}
    assert len(captions) > 450


def test_rendered_colour_sits_in_its_cell():
    rng = random.Random(5)
    shape = synth.Shape("square", "red", "large", (2, 0), (0.0, 0.0))
    img = synth.render([shape], 48, rng)
    r, g, b = img.getpixel((8, 40))  # centre of the bottom-left cell
    assert (r, g, b) == synth.COLORS["red"]
    r, g, b = img.getpixel((40, 8))  # top-right cell is background
    assert max(r, g, b) <= 80


def test_cli_writes_manifests(cli, tmp_path):
    res = cli("data", "synth", "--out", tmp_path / "s", "--num", "40", "--val", "10", "--seed", "0")
    assert res.returncode == 0, res.stderr
    assert len(_rows(tmp_path / "s" / "train.jsonl")) == 40
    res = cli("data", "synth", "--out", tmp_path / "s", "--num", "4", "--val", "1", "--text-only-fraction", "1.5")
    assert res.returncode != 0 and "text-only-fraction" in res.stderr and "Traceback" not in res.stderr


def test_synth_writes_a_tokenizer_and_the_next_command_trains(cli, tmp_path):
    proc = cli("data", "synth", "--out", "D", "--num", 40, "--val", 8, "--workers", 1)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "D" / "tokenizer.json").is_file()
    next_line = next(line for line in proc.stdout.splitlines() if line.startswith("next: "))
    args = next_line.removeprefix("next: vltrain ").split()
    args[1] = str(Path(__file__).resolve().parents[3] / "configs" / "demo.yaml")
    run = cli(*args, "train.max_steps=2", "data.batch_size=8", "eval.batch_size=8", "run.dir=R",
              "train.progress=false", "data.num_workers=0", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_missing_tokenizer_names_the_command_that_makes_it(cli, tmp_path):
    synth.synthesize(tmp_path / "D", num=20, val=4, workers=1)
    repo_config = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
    proc = cli("train", repo_config, "data.train=D/train.jsonl", "data.val=D/val.jsonl", "train.max_steps=1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "tokenizer not found: data/shapes/tokenizer.json" in proc.stderr
    assert "vltrain tokenizer train D/train.jsonl --out data/shapes/tokenizer.json" in proc.stderr


def test_image_only_fraction_drops_captions_and_leaves_the_other_rows(tmp_path):
    base = _rows(synth.synthesize(tmp_path / "a", num=300, val=20, text_only_fraction=0.2, seed=3, workers=1)["train"])
    mixed = _rows(synth.synthesize(tmp_path / "b", num=300, val=20, text_only_fraction=0.2, seed=3, workers=1,
                                   image_only_fraction=0.3)["train"])
    image_only = [m for m in mixed if "text" not in m]
    assert 60 <= len(image_only) <= 120  # 30% of 300, with sampling noise
    assert all("image" in m for m in image_only)
    # the same draw picks the modality: text-only rows stay, the rest only lose captions
    for b, m in zip(base, mixed):
        assert ("image" in b) == ("image" in m)
        assert "text" not in m or m["text"] == b["text"]
    assert _rows(tmp_path / "a" / "val.jsonl") == _rows(tmp_path / "b" / "val.jsonl")


def test_regions_box_each_shape_with_a_phrase_of_its_own(tmp_path):
    """Each region's box is its shape's extent in the image (the pixels of its colour in its cell),
    its phrase names the shape's size, colour and kind and is unique in its image; the rows and
    images are those written without regions."""
    import numpy as np
    from PIL import Image

    plain = _rows(synth.synthesize(tmp_path / "a", num=120, val=0, text_only_fraction=0.1, seed=4, workers=1)["train"])
    rows = _rows(synth.synthesize(tmp_path / "b", num=120, val=0, text_only_fraction=0.1, seed=4, workers=1,
                                  with_regions=True)["train"])
    assert [{k: v for k, v in r.items() if k != "regions"} for r in rows] == plain
    assert all(("regions" in r) == ("image" in r) for r in rows)
    for row in [r for r in rows if "image" in r]:
        pixels = np.asarray(Image.open(tmp_path / "b" / row["image"]).convert("RGB")).astype(int)
        phrases = [r["text"] for r in row["regions"]]
        assert len(set(phrases)) == len(phrases)
        for region in row["regions"]:
            x0, y0, x1, y1 = region["box"]
            assert any(f" {c} " in region["text"] for c in synth.COLORS)
            col, line = int((x0 + x1) / 2 // 16), int((y0 + y1) / 2 // 16)  # its cell of the 48 px grid
            cell = pixels[line * 16:(line + 1) * 16, col * 16:(col + 1) * 16]
            drawn = np.abs(cell - pixels[0, 0]).sum(-1) > 20  # off the background, a shape's edge pixels too
            ys, xs = np.nonzero(drawn)
            found = (xs.min() + col * 16, ys.min() + line * 16, xs.max() + 1 + col * 16, ys.max() + 1 + line * 16)
            assert np.allclose(found, region["box"], atol=1.5), (row["id"], region, found)


def test_cli_synth_regions_writes_rows_validate_accepts(cli, tmp_path):
    res = cli("data", "synth", "--out", tmp_path / "s", "--num", "30", "--val", "5", "--regions", "--workers", "1")
    assert res.returncode == 0, res.stderr
    assert all("regions" in r for r in _rows(tmp_path / "s" / "val.jsonl"))
    res = cli("data", "validate", tmp_path / "s" / "train.jsonl", "--workers", "1")
    assert res.returncode == 0 and "0 error(s)" in res.stdout, res.stdout + res.stderr


def test_default_manifests_are_pinned(tmp_path):
    """The default data, byte for byte, as it was before long captions had a stream of their own."""
    paths = synth.synthesize(tmp_path / "a", num=60, val=10, text_only_fraction=0.2, seed=2, workers=1,
                             with_regions=True)
    digest = {split: hashlib.sha256(p.read_bytes()).hexdigest() for split, p in paths.items()}
    assert digest == {"train": "6913ef415210341f03582637015b499b80b3eb578fadb35c3b6c8148f816e8c5",
                      "val": "551d656ab5e667a52315bb4bfe61f72743f11e7936cd9d66694ed90a68315290"}


def test_long_captions_name_many_shapes_in_reading_order(tmp_path):
    a = _rows(synth.synthesize(tmp_path / "a", num=40, val=10, seed=1, workers=1, long_captions=True)["train"])
    b = _rows(synth.synthesize(tmp_path / "b", num=40, val=10, seed=1, workers=2, long_captions=True)["train"])
    assert a == b  # deterministic, whatever the workers
    plain = _rows(synth.synthesize(tmp_path / "c", num=40, val=0, seed=1, workers=1)["train"])
    assert all(len(x["text"]) > 2 * len(y["text"]) for x, y in zip(a, plain))
    for i in range(300):
        rng = random.Random(i)
        shapes = synth.sample_long_scene(rng)
        assert 6 <= len(shapes) <= 9 and [s.cell for s in shapes] == sorted({s.cell for s in shapes})
        text = synth.describe_long(shapes, rng)
        assert synth.COUNT_WORDS[len(shapes)] in text
        clauses = re.split(r"; and |, and finally |; last, |; ", text.split(": ", 1)[1])
        assert len(clauses) == len(shapes)
        for s, clause in zip(shapes, clauses):  # a clause each, in the order of the cells
            assert s.color in clause and any(w in clause for w in synth.KIND_WORDS[s.kind]), (clause, s)
            assert any(re.search(rf"the {w}( holds| there|$)", clause) for w in synth.CELL_WORDS[s.cell]), (clause, s)


def test_most_long_captions_pass_clips_77_tokens(tmp_path):
    """Measured with OpenCLIP's BPE (the tokenizer of CLIP checkpoints)."""
    import numpy as np
    import pytest

    from vltrain.data.tokenizers import load_tokenizer
    from vltrain.data.tools.openclip_tokenizer import find_vocab, openclip_tokenizer

    if find_vocab() is None:
        pytest.skip("open_clip_torch's vocabulary is not installed")
    openclip_tokenizer().save(str(tmp_path / "clip.json"))
    tok = load_tokenizer(str(tmp_path / "clip.json"), "clip")
    rows = _rows(synth.synthesize(tmp_path / "d", num=300, val=0, seed=0, workers=1, long_captions=True)["train"])
    lengths = np.array([len(tok.encode(r["text"], 1000)[0]) for r in rows])
    assert (lengths > 77).mean() > 0.7 and lengths.max() < 160


def test_cli_long_captions(cli, tmp_path):
    res = cli("data", "synth", "--out", tmp_path / "s", "--num", "8", "--val", "2", "--long-captions", "--workers", "1")
    assert res.returncode == 0, res.stderr
    assert "data.max_text_length=160" in res.stdout
    assert all(" shapes, from the top row down: " in r["text"] for r in _rows(tmp_path / "s" / "val.jsonl"))


def test_masks_class_each_pixel_as_drawn_and_leave_the_data_as_it_was(tmp_path):
    """A mask pixel holds the class of the shape drawn there (the centre of each shape, by kind),
    the background elsewhere (the corners of every cell); the rows and images are those written
    without masks, and only the val images get one."""
    import numpy as np
    from PIL import Image

    plain = synth.synthesize(tmp_path / "a", num=20, val=12, seed=3, workers=1)
    masked = synth.synthesize(tmp_path / "b", num=20, val=12, seed=3, workers=1, with_masks=True)
    for split in ("train", "val"):
        assert masked[split].read_bytes() == plain[split].read_bytes()
    dense = _rows(tmp_path / "b" / "dense.jsonl")
    assert [r["image"] for r in dense] == [r["image"] for r in _rows(masked["val"])]
    assert json.loads((tmp_path / "b" / "dense_classes.json").read_text()) == ["background", *synth.KINDS]
    assert not (tmp_path / "a" / "dense.jsonl").exists() and not (tmp_path / "b" / "masks" / "train").exists()
    for row in dense:
        image = tmp_path / "b" / row["image"]
        assert image.read_bytes() == (tmp_path / "a" / row["image"]).read_bytes()
        mask = Image.open(tmp_path / "b" / row["mask"])
        assert mask.mode == "L" and mask.size == Image.open(image).size == (48, 48)
        m = np.asarray(mask)
        rng = synth._rng(3, "val", int(Path(row["image"]).stem))
        shapes = {s.cell: s for s in synth.sample_scene(rng)}
        for r in range(3):
            for c in range(3):
                y, x = r * 16 + 8, c * 16 + 8
                want = synth.MASK_CLASSES.index(shapes[(r, c)].kind) if (r, c) in shapes else 0
                assert m[y, x] == want, (row, (r, c))
                assert m[r * 16, c * 16] == 0 and m[r * 16 + 15, c * 16 + 15] == 0
        pixels = np.asarray(Image.open(image).convert("RGB")).astype(int)
        bare = (pixels == pixels[0, 0]).all(-1)  # wholly background; wholly a shape's colour:
        covered = np.any([(pixels == synth.COLORS[s.color]).all(-1) for s in shapes.values()], axis=0)
        assert (m[bare] == 0).all() and (m[covered] > 0).all()


def test_cli_synth_masks(cli, tmp_path):
    res = cli("data", "synth", "--out", tmp_path / "s", "--num", "10", "--val", "4", "--masks", "--workers", "1")
    assert res.returncode == 0, res.stderr
    assert len(_rows(tmp_path / "s" / "dense.jsonl")) == 4 and "--dense" in res.stdout
