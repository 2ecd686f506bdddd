import json

import pytest
from kits.datafiles import distinct_image, run_cli, save, tiny_tokenizer, write_jsonl

from vltrain.data.tools.validate import validate


def clean_manifest(tmp_path, n=6):
    rows = []
    for i in range(n):
        row = {"id": f"r{i}", "text": f"red circle {i}"}
        if i % 3:
            row["image"] = f"img/{i}.png"
            save(distinct_image(i, (12 + i, 10)), tmp_path / "img" / f"{i}.png")
        rows.append(row)
    return write_jsonl(tmp_path / "clean.jsonl", rows)


def broken_manifest(tmp_path):
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "zero.png").write_bytes(b"")
    (tmp_path / "img" / "notimg.jpg").write_text("hello")
    save(distinct_image(1), tmp_path / "img" / "ok.png")
    return write_jsonl(
        tmp_path / "broken.jsonl",
        [
            {"id": "a", "image": "img/ok.png", "text": "fine"},
            {"id": "b", "image": "img/zero.png", "text": "x"},
            "{not json",
            {"id": "c", "image": "img/gone.png"},
            {"id": "a", "text": "duplicate id"},
            {"id": "d", "image": "img/notimg.jpg", "text": ""},
        ],
    )


def test_clean_manifest_exits_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean_manifest(tmp_path)
    r = run_cli(capsys, "data", "validate", "clean.jsonl")
    assert r[0] == 0, r[1] + r[2]
    assert "clean.jsonl: 6 rows (4 image-text, 2 text-only, 0 image-only); 0 error(s)" in r[1]


def test_problems_are_listed_with_file_line_and_reason(tmp_path):
    broken_manifest(tmp_path)
    [s] = validate([str(tmp_path / "broken.jsonl")])
    got = {(p.where, p.level): p.reason for p in s.problems}
    assert "empty file" in got[("broken.jsonl:2", "error")]
    assert "not JSON" in got[("broken.jsonl:3", "error")]
    assert "image file not found: img/gone.png" in got[("broken.jsonl:4", "error")]
    assert "duplicate id 'a' (first at broken.jsonl:1)" in got[("broken.jsonl:5", "error")]
    assert "not an image" in got[("broken.jsonl:6", "error")]
    assert "empty text" in got[("broken.jsonl:6", "warning")]
    assert (s.rows, s.errors, s.warnings) == (5, 5, 1)


def test_problems_exit_one_and_json_report(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    broken_manifest(tmp_path)
    r = run_cli(capsys, "data", "validate", "broken.jsonl", "--max-problems", "2")
    assert r[0] == 1
    assert "broken.jsonl:2" in r[1] and "and 4 more" in r[1] and "5 problem(s) found" in r[1]
    r = run_cli(capsys, "data", "validate", "broken.jsonl", "--json")
    assert r[0] == 1
    report = json.loads(r[1])
    assert report["ok"] is False and report["sources"][0]["errors"] == 5
    assert {"where", "reason", "level"} <= set(report["sources"][0]["problems"][0])


@pytest.mark.parametrize("arg", ["missing.jsonl", "table.feather", "shards/{00000..00003}.tar"])
def test_usage_errors_exit_two(tmp_path, capsys, monkeypatch, arg):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "table.feather").write_bytes(b"x")
    r = run_cli(capsys, "data", "validate", arg)
    assert r[0] == 2 and "vltrain: error:" in r[2] and "Traceback" not in r[2]


def test_workers_find_the_same_problems(tmp_path):
    rows = [{"id": f"r{i}", "image": f"img/{i % 7}.png" if i % 50 else "img/gone.png", "text": "t"} for i in range(300)]
    for i in range(7):
        save(distinct_image(i), tmp_path / "img" / f"{i}.png")
    m = str(write_jsonl(tmp_path / "m.jsonl", rows))
    one, two = validate([m], 1)[0], validate([m], 2)[0]
    assert [str(p) for p in one.problems] == [str(p) for p in two.problems]
    assert one.errors == 6


def test_stats(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean_manifest(tmp_path)
    tiny_tokenizer(tmp_path).save(tmp_path / "tok.json")
    r = run_cli(capsys, "data", "stats", "clean.jsonl", "--json", "--tokenizer", "tok.json")
    assert r[0] == 0, r[2]
    s = json.loads(r[1])
    assert (s["rows"], s["image_text"], s["text_only"], s["image_only"]) == (6, 4, 2, 0)
    assert s["caption_length"]["unit"] == "tokens" and s["caption_length"]["max"] >= 4
    assert s["images_measured"] == 4 and s["image_width"]["max"] == 17 and s["image_height"]["p50"] == 10
    r = run_cli(capsys, "data", "stats", "clean.jsonl")
    assert r[0] == 0 and "caption (words)" in r[1] and "image-text" in r[1]


def test_every_image_problem_names_the_image_path_and_a_plain_reason(cli, tmp_path):
    import io
    import json
    import os

    from PIL import Image

    im = Image.new("RGB", (64, 64), (200, 30, 30))
    jpg, png = io.BytesIO(), io.BytesIO()
    im.save(jpg, "JPEG")
    im.save(png, "PNG")
    bomb = io.BytesIO()
    Image.new("1", (20000, 20000)).save(bomb, "PNG")  # 400 M pixels in a small file
    (tmp_path / "img" / "dir.jpg").mkdir(parents=True)
    files = {
        "trunc.jpg": (jpg.getvalue()[:300], "truncated or corrupt"),
        "trunc.png": (png.getvalue()[: len(png.getvalue()) // 2], "truncated or corrupt"),
        "empty.jpg": (b"", "empty file"),
        "text.jpg": (b"hello, not an image\n", "not an image"),
        "bomb.png": (bomb.getvalue(), "decompression bomb"),
    }
    for name, (data, _) in files.items():
        (tmp_path / "img" / name).write_bytes(data)
    expected = {**{f"img/{n}": why for n, (_, why) in files.items()},
                "img/dir.jpg": "is a directory", "img/missing.jpg": "not found"}
    with open(tmp_path / "bad.jsonl", "w") as f:
        for i, path in enumerate(expected):
            f.write(json.dumps({"id": str(i), "image": path, "text": "a red square"}) + "\n")
    proc = cli("data", "validate", "bad.jsonl")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("error:")]
    assert len(lines) == len(expected), proc.stdout
    for line, (path, why) in zip(lines, expected.items()):
        assert path in line and why in line, line
        assert "Errno" not in line
    if os.geteuid() != 0:  # root reads any file: no permission case there
        locked = tmp_path / "img" / "trunc.jpg"
        locked.chmod(0)
        assert "permission denied" in cli("data", "validate", "bad.jsonl").stdout


def test_an_empty_manifest_is_a_problem_as_training_says(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty.jsonl").write_text("")
    code, out, _ = run_cli(capsys, "data", "validate", str(tmp_path / "empty.jsonl"))
    assert code == 1
    assert "0 rows" in out and "no rows: training refuses an empty source" in out and "ok" not in out.splitlines()


def test_validate_uses_every_core_and_shows_progress_on_a_terminal(tmp_path, capsys):
    from vltrain.cli.main import build_parser

    assert build_parser().parse_args(["data", "validate", "m.jsonl"]).workers == 0  # one per core
    clean_manifest(tmp_path)
    validate([str(tmp_path / "clean.jsonl")], progress=True)
    assert "validating " in capsys.readouterr().err


def test_bad_regions_are_one_line_each_naming_the_row(tmp_path, capsys, monkeypatch):
    """Boxes outside the image as shown, inverted, not numbers, and empty phrases: each row's first
    bad region, one error line with the row, what is wrong and the id. A box that fits only the
    image as shown (an EXIF-turned JPEG) is fine."""
    import io

    import webdataset as wds
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    save(distinct_image(1, (40, 30)), tmp_path / "a.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40 x 30, shown 30 x 40
    save(distinct_image(2, (40, 30)), tmp_path / "turned.jpg", exif=exif.tobytes())

    def row(i, image, *boxes, text="a thing"):
        return {"id": f"r{i}", "image": image, "text": "x", "regions": [{"box": b, "text": text} for b in boxes]}

    write_jsonl(tmp_path / "m.jsonl", [
        row(1, "a.png", [0, 0, 40, 30]),
        row(2, "a.png", [0, 0, 10, 10], [30, 20, 41, 30]),  # outside
        row(3, "a.png", [20, 5, 10, 25]),  # inverted
        row(4, "a.png", [0, "zero", 10, 10]),  # not a number
        row(5, "a.png", [0, 0, 10, 10], text=""),  # no phrase
        row(6, "turned.jpg", [0, 0, 30, 40]),  # fits the shown image, not the stored one
        row(7, "turned.jpg", [0, 0, 40, 30]),
        {"id": "r8", "text": "no image", "regions": [{"box": [0, 0, 1, 1], "text": "a"}]},
    ])
    code, out, _ = run_cli(capsys, "data", "validate", "m.jsonl")
    assert code == 1
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith(("error:", "warning:"))]
    assert lines == [
        "error: m.jsonl:2: regions[1]: box [30, 20, 41, 30] is not inside the 40x30 image (boxes are in pixels of "
        "the image as shown, after its EXIF orientation) (id r2)",
        "error: m.jsonl:3: regions[0]: box [20, 5, 10, 25] is empty or inverted (it needs x0 < x1 and y0 < y1) (id r3)",
        'error: m.jsonl:4: regions[0]: box must be 4 numbers [x0, y0, x1, y1], got [0, "zero", 10, 10] (id r4)',
        'error: m.jsonl:5: regions[0]: text must be a phrase, got "" (id r5)',
        "error: m.jsonl:7: regions[0]: box [0, 0, 40, 30] is not inside the 30x40 image (boxes are in pixels of "
        "the image as shown, after its EXIF orientation) (id r7)",
        "warning: m.jsonl:8: regions on a row without an image are ignored (id r8)",
    ]
    buf = io.BytesIO()
    distinct_image(3, (40, 30)).save(buf, "PNG")
    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        sink.write({"__key__": "k0", "png": buf.getvalue(), "txt": "x",
                    "json": {"regions": [{"box": [0, 0, 50, 10], "text": "a"}]}})
    [s] = validate([str(tmp_path / "00000.tar")])
    found = [(p.where, p.reason.split(" is ")[0]) for p in s.problems]
    assert found == [("00000.tar:k0", "regions[0]: box [0, 0, 50, 10]")]
