"""The sample index: the same rows as parsing the source, built once, in parts, keyed by what it depends on."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import numpy as np
import pytest
from kits.datafiles import caption, distinct_image, save, sha, tiny_tokenizer, write_jsonl

from vltrain.data.index import build as index_build
from vltrain.data.index import lengths as index_lengths
from vltrain.data.index.open import open_indexed
from vltrain.data.sources.manifests import ManifestSource
from vltrain.data.sources.shards import ShardSource, write_shards


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def manifest(tmp_path: Path, n: int = 40) -> Path:
    """Rows with given and derived ids, text-only and image-only rows, a blank line and three malformed rows."""
    rows = []
    for i in range(n):
        if i % 4 != 1:
            save(distinct_image(i), tmp_path / "img" / f"{i}.png")
        row = {"image": f"img/{i}.png", "text": caption(i)}
        if i % 4 == 1:
            row.pop("image")
        if i % 4 == 2:
            row.pop("text")
        if i % 3 == 0:
            row["id"] = f"given-{i}"
        rows.append(row)
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    lines = path.read_text().splitlines()
    lines[5:5] = ["", "{not json", '{"text": 7}', '{"caption": "   "}']
    path.write_text("\n".join(lines) + "\n")
    return path


def same_rows(indexed, parsed) -> None:
    assert len(indexed) == len(parsed)
    for i in range(len(parsed)):
        assert indexed.row(i) == parsed.row(i)
        if parsed.row(i).image is not None:
            assert indexed.read_image(i) == parsed.read_image(i)
    assert indexed.has_image().tolist() == parsed.has_image().tolist()
    assert indexed.has_text().tolist() == [t is not None for t in parsed.texts()]


def test_manifest_rows_problems_and_lengths_match_the_parsed_source(tmp_path, tok):
    path = manifest(tmp_path)
    src = open_indexed(str(path), tok, 16)
    parsed = ManifestSource(path)
    same_rows(src, parsed)
    assert [str(p) for p in src.problems] == [str(p) for p in parsed.problems]
    assert src.error_count() == 3 and "m.jsonl:7" in str(src.errors()[0])
    assert src.text_len().tolist() == tok.token_lengths(parsed.texts(), 16)
    assert src.index_dir.parent == tmp_path / ".vltrain-index" and src.built_now


def test_csv_with_a_quoted_line_break(tmp_path, tok):
    save(distinct_image(0), tmp_path / "a.png")
    path = tmp_path / "m.csv"
    path.write_text('image,text\na.png,"two\nlines"\n,only text\nbad,row,extra\n')
    src = open_indexed(str(path), tok, 16)
    same_rows(src, ManifestSource(path))
    assert src.row(0).text == "two\nlines" and src.row(1).where == "m.csv:4"
    assert [str(p) for p in src.errors()] == ["m.csv:5: 3 fields, the header has 2"]


def test_shard_rows_match_the_parsed_shards(tmp_path, tok):
    written, _ = write_shards(ManifestSource(manifest(tmp_path)), tmp_path / "sh", 9)
    pattern = str(tmp_path / "sh" / f"{{00000..{len(written) - 1:05d}}}.tar")
    src = open_indexed(pattern, tok, 16)
    same_rows(src, ShardSource(pattern))
    assert src.blocks().tolist() == [0, 9, 18, 27, 36, 40]


def test_reopening_reads_the_index_and_changes_rebuild_it(tmp_path, tok, tmp_path_factory):
    path = manifest(tmp_path)
    first = open_indexed(str(path), tok, 16)
    tok.encode("a caption cut short", 3)  # the tokenizer's own truncation state must not matter
    again = open_indexed(str(path), tok, 16)
    assert not again.built_now and again.index_dir == first.index_dir
    assert again.lengths_at_hand() is None  # token counts are made on first use only
    lengths = again.text_len()
    assert again.lengths_file.is_file() and open_indexed(str(path), tok, 16).lengths_at_hand() is not None
    short = open_indexed(str(path), tok, 4)  # another max_text_length: the same index, other counts
    assert short.index_dir == first.index_dir and short.lengths_file != again.lengths_file
    assert short.text_len().max() == 4 and np.array_equal(short.text_len(), np.minimum(lengths, 4))
    other_tok = tiny_tokenizer(tmp_path_factory.mktemp("tok2"), kind="bpe")
    other = open_indexed(str(path), other_tok, 16)
    assert other.index_dir == first.index_dir and other.lengths_file != again.lengths_file
    parsed = ManifestSource(path)
    assert other.text_len().tolist() == other_tok.token_lengths(parsed.texts(), 16)
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more row"}) + "\n")
    grown = open_indexed(str(path), tok, 16)
    assert grown.built_now and len(grown) == len(first) + 1 and grown.row(len(first)).text == "one more row"


def test_parts_in_parallel_equal_one_part_and_an_interrupted_build_resumes(tmp_path, tok, monkeypatch):
    path = manifest(tmp_path, 200)
    whole = open_indexed(str(path), tok, 16)
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / "m.jsonl"
    copy.write_bytes(path.read_bytes())
    (tmp_path / "copy" / "img").symlink_to(tmp_path / "img")
    monkeypatch.setattr(index_build, "PART_BYTES", 997)  # many parts, cut mid-line
    monkeypatch.setattr(index_build, "MIN_PARALLEL_BYTES", 0)  # and build processes even for this
    calls = []
    real = index_build._write_part

    def dies_after_three(parts_dir, k, *args):
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        calls.append(k)
        real(parts_dir, k, *args)

    monkeypatch.setattr(index_build, "_write_part", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        open_indexed(str(copy), tok, 16)
    monkeypatch.setattr(index_build, "_write_part", real)
    parts = sorted(p.name for p in (tmp_path / "copy" / ".vltrain-index").glob("*.parts/part-*.json"))
    assert len(parts) == 3
    resumed = open_indexed(str(copy), tok, 16, workers=2)
    for name in whole.columns:
        assert np.array_equal(whole.columns[name], resumed.columns[name]), name
    monkeypatch.setattr(index_lengths, "MIN_PARALLEL_CAPTIONS", 0)
    assert np.array_equal(whole.text_len(), resumed.text_len())  # counted in 997-byte parts, 2 processes
    assert [str(p) for p in whole.problems] == [str(p) for p in resumed.problems]
    assert not list((tmp_path / "copy" / ".vltrain-index").rglob("*.parts"))


def test_read_only_data_is_indexed_in_the_cache_folder(tmp_path, tok, monkeypatch):
    path = manifest(tmp_path / "data")
    monkeypatch.setattr(index_build.os, "access", lambda p, mode: Path(p) != tmp_path / "data")
    src = open_indexed(str(path), tok, 16, cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache" / "index") in src.index_dir.parents
    assert not (tmp_path / "data" / ".vltrain-index").exists() and len(src) == 40


def _open_and_report(path, tok_path, out):
    from vltrain.data.tokenizers import load_tokenizer

    out.put(open_indexed(path, load_tokenizer(tok_path), 16).built_now)


def test_two_processes_at_once_build_once(tmp_path, tok):
    path = manifest(tmp_path, 400)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_and_report, args=(str(path), tok.path, out)) for _ in range(2)]
    for p in procs:
        p.start()
    built = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert built == [False, True]


def test_cli_builds_reports_and_exits_one_for_dropped_rows(tmp_path, tok, cli):
    path = manifest(tmp_path)
    res = cli("data", "index", path, "--tokenizer", tok.path, "--max-text-length", "16")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "40 samples, 3 malformed row(s) dropped" in res.stdout and "index built" in res.stdout
    assert "token counts made" in res.stdout
    res = cli("data", "index", path, "--tokenizer", tok.path, "--max-text-length", "16")
    assert "index up to date" in res.stdout and "token counts up to date" in res.stdout
    res = cli("data", "index", path)
    assert res.returncode == 1 and "index up to date" in res.stdout and "token counts: not made" in res.stdout
    res = cli("data", "index", tmp_path / "nope.jsonl", "--tokenizer", tok.path)
    assert res.returncode == 2 and "manifest not found" in res.stderr and "Traceback" not in res.stderr


def test_validate_and_stats_read_the_index_where_one_exists(tmp_path, tok):
    from vltrain.data.tools.validate import stats, validate

    path = manifest(tmp_path)
    parsed = validate([str(path)])[0]
    parsed_stats = stats([str(path)], tok.path, 10)
    src = open_indexed(str(path), tok, 64)
    src.text_len()
    indexed = validate([str(path)])[0]
    assert (indexed.rows, indexed.image_text, indexed.text_only, indexed.image_only, indexed.errors,
            indexed.warnings) == (parsed.rows, parsed.image_text, parsed.text_only, parsed.image_only,
                                  parsed.errors, parsed.warnings)
    assert [str(p) for p in indexed.problems] == [str(p) for p in parsed.problems]
    indexed_stats = stats([str(path)], tok.path, 10)
    assert indexed_stats["caption_length"]["unit"] == "tokens, from the index: capped at 64"
    assert {k: v for k, v in indexed_stats["caption_length"].items() if k != "unit"} == \
        {k: v for k, v in parsed_stats["caption_length"].items() if k != "unit"}
    assert src.index_dir.is_dir()


def test_jsonl_edge_lines_parse_as_line_by_line(tmp_path, tok):
    """The chunked parse gives each line's own verdict: two values on a line, a list, bad UTF-8,
    a lone surrogate, CRLF endings and a last line without its line break."""
    save(distinct_image(0), tmp_path / "a.png")
    lines = [b'{"image": "a.png", "text": "one"}\r', b'{"text": "two"}, {"text": "three"}', b'["x"]',
             b'{"text": "caf\xe9"}', b'{"text": "\xed\xa0\x80"}', b'{"text": "\\ud800"}', b'', b'{"text": "last"}']
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\n".join(lines))  # no final line break
    src = open_indexed(str(path), tok, 16)
    parsed = ManifestSource(path)
    same_rows(src, parsed)
    assert [str(p) for p in src.problems] == [str(p) for p in parsed.problems]
    assert [src.row(i).text for i in range(len(src))] == ["one", "last"]


ODD_LINES = [b'{"text": "caption"}', b'{"image": "a.png"}', b'{"caption": "c", "image_path": "p.png"}',
             b'{"image": "a.png", "text": "  "}', b'{"image": " ", "text": "t"}', b'{"text": "caf\\u00e9"}',
             b'{"text": "\\ud800"}', b'{"text": "\xff"}', b'{"text": "a [sic] b", "image": "a.png"}',
             b'{"text": "t", "tags": ["a", "b"]}', b'{"text": "t", "meta": {"w": 1}}', b' {"text": "lead"}', b"",
             b"   ", b'{"text": "crlf", "image": "a.png"}\r', b"{nope", b'{"text": "a"}, {"text": "b"}', b'["x"]',
             b"3", b'{"id": true, "text": "t"}', b'{"id": 1.5, "text": "t"}', b'{"id": "", "text": "t"}',
             b'{"text": 7}', b'{"image": null, "text": "t"}', b'{"image": null, "image_path": "p.png", "text": "t"}',
             b'{"image": "", "text": "t"}', b'{"text": "t", "x": NaN}', b'{"text": "a", "text": "b"}',
             '{"text": "日本語", "image": "a.png"}'.encode(), b'{"text": "a\tb"}', b'{"id": "\\udc00", "text": "t"}',
             b'{"id": 3, "text": "t", "image": "a.png"}', b'{"text": "t", "image": "a.png", "id": null}']


def odd_manifest(path: Path, rng_seed: int = 3) -> Path:
    """12,000 lines: plain rows in long runs (read in bulk), then runs mixing every odd line a
    manifest can hold; the last line has no line break."""
    import random

    rng = random.Random(rng_seed)
    lines = []
    for i in range(12000):
        plain = b'{"id": "r%d", "image": "img/%d.png", "text": "caption %d"}' % (i, i % 7, i)
        odd = 5000 <= i < 8000 and rng.random() < 0.3 or i in (4500, 11000)
        lines.append(rng.choice(ODD_LINES) if odd else plain if i < 9000 else plain.replace(b'"r%d"' % i, b"%d" % i))
    path.write_bytes(b"\n".join(lines))
    return path


def index_digest(index_dir: Path) -> dict:
    """The index's columns and problems, as digests; and its counts."""
    meta = json.loads((index_dir / "meta.json").read_text())
    files = [f"{c}.npy" for c in index_build.COLUMNS] + ["problems.jsonl"]
    return {"files": {f: sha((index_dir / f).read_bytes())[:16] for f in files},
            "counts": [meta["count"], meta["errors"], meta["warnings"]]}


BEFORE = {
    "jsonl": {"counts": [11608, 333, 76], "files": {
        "offset.npy": "5d91bb30736e19d2", "length.npy": "4b388a4836ba377c", "line.npy": "bb68c0c854e9ef01",
        "has_image.npy": "f04dd9b3a8b8c8bd", "has_text.npy": "4d940d42e2b7abcd", "problems.jsonl": "92b9e08c624241b0"}},
    "csv": {"counts": [3, 2, 0], "files": {
        "offset.npy": "9e0cc2937bd17699", "length.npy": "5fdc64b92a49813f", "line.npy": "c409cd0e1d4fc1e7",
        "has_image.npy": "67c5322b3a41bd51", "has_text.npy": "0284b5a32c95b425", "problems.jsonl": "c26c855be72a3cf2"}},
    "shards": {"counts": [336, 9, 3], "files": {
        "offset.npy": "b99222ba2b0f56e4", "length.npy": "ba9cc0ca0063add1", "line.npy": "5a1652f6e73e8c96",
        "has_image.npy": "fe91a13c962aee71", "has_text.npy": "42f19c1b095557e1", "problems.jsonl": "e7331b08d5b86c71"}},
}
"""Digests of the indexes of ``odd_manifest``, a CSV and ``odd_shards``, made before the bulk scans."""


def test_the_index_holds_what_it_held_before(tmp_path, monkeypatch):
    """Digests of indexes built before the bulk scans: the columns, problems.jsonl and the counts
    of meta.json are the same byte for byte, built in one part or in many (of few lines a parse)."""
    from kits.shardkit import odd_shards

    csv_path = tmp_path / "m.csv"
    csv_path.write_text('id,image,text\n1,a.png,"two\nlines"\n2,,only text\n3,bad,row,extra\n4,b.png,\n5,,\n')
    specs = {"jsonl": str(odd_manifest(tmp_path / "m.jsonl")), "csv": str(csv_path),
             "shards": odd_shards(tmp_path / "sh")}
    got = {kind: index_digest(open_indexed(spec, None, 16).index_dir) for kind, spec in specs.items()}
    assert got == BEFORE
    monkeypatch.setattr(index_build, "PART_BYTES", 50_000)
    monkeypatch.setattr(index_build, "SHARDS_PER_PART", 5)
    monkeypatch.setattr(index_build, "JSON_CHUNK", 7)
    for kind, spec in specs.items():
        shutil.rmtree(open_indexed(spec, None, 16).index_dir)
        assert index_digest(open_indexed(spec, None, 16).index_dir) == BEFORE[kind], kind


def test_json_pieces_are_parsed_together_only_when_each_is_one_object():
    """One parse stands for many only where it provably gives each piece's own value."""
    from vltrain.data.sources.json_bulk import SEPARATOR, loads_objects

    def parsed(*pieces: bytes):
        return loads_objects(SEPARATOR.join(pieces), len(pieces))

    assert parsed(b'{"a": 1}', b'{"b": {"c": 3}}\r', b'{"d": "x"}') == [{"a": 1}, {"b": {"c": 3}}, {"d": "x"}]
    assert parsed(b'{"a": "[x]"}', b'{"b": 2}') == [{"a": "[x]"}, {"b": 2}]
    assert parsed(b'{"a": "x', b'y"}, {"text": "z"}') is None  # a string across pieces
    assert parsed(b'{"a": [{"b": 1}', b'{"c": 2}]}, {"text": "x"}') is None  # an array across pieces
    assert parsed(b'{"a": [1]}', b'{"b": 2}') is None  # maybe sure, not provably: one by one
    assert parsed(b'{"a": 1}', b' {"b": 2}') is None and parsed(b'{"a": 1}', b"") is None
    assert parsed(b'{"a": 1}, {"b": 2}', b'{"c": 3}') is None and parsed(b'["x"]', b'{"a": 1}') is None
    assert parsed(b'{"a": "\xff"}') is None and parsed(b'{"a": "tab\there"}') is None


def test_lines_that_only_parse_together_are_refused_one_by_one(tmp_path):
    """Two lines cut inside an array or a string parse as one array's values (the counts even
    agree), but neither line is an object on its own: both are malformed rows, not samples."""
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"a": [{"b": 1}\n{"c": 2}]}, {"text": "x"}\n{"text": "y", "a": "x\n'
                     b'z"}, {"text": "w"}\n' + b'{"text": "plain"}\n' * 5)
    src = open_indexed(str(path), None, 16)
    parsed = ManifestSource(path)
    assert [src.row(i) for i in range(len(src))] == [parsed.row(i) for i in range(len(parsed))]
    where = [f"m.jsonl:{k}" for k in (2, 3, 4, 5)]
    assert [p.where for p in src.problems] == [p.where for p in parsed.problems] == where
