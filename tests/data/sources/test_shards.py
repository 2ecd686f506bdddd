import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from kits.datafiles import distinct_image, run_cli, write_jsonl
from kits.shardkit import add, make_manifest, odd_shards, tar_of

from vltrain.data.sources.manifests import ManifestSource
from vltrain.data.sources.shards import ShardSource, build_index, index_path, load_index, write_shards
from vltrain.errors import DataError


def test_written_shards_read_back_row_for_row(tmp_path):
    manifest = ManifestSource(make_manifest(tmp_path))
    written, skipped = write_shards(manifest, tmp_path / "shards", shard_size=3)
    assert [p.name for p in written] == ["00000.tar", "00001.tar", "00002.tar"] and not skipped
    shards = ShardSource(str(tmp_path / "shards" / "{00000..00002}.tar"))
    assert len(shards) == len(manifest)
    assert ShardSource(str(tmp_path / "shards" / "*.tar")).paths == shards.paths
    for i in range(len(manifest)):
        a, b = manifest.row(i), shards.row(i)
        assert (a.key, a.text) == (b.key, b.text)
        assert (a.image is None) == (b.image is None)
        if a.image is not None:
            assert shards.read_image(i) == manifest.read_image(i)
    assert shards.has_image().tolist() == manifest.has_image().tolist()
    with tarfile.open(written[0]) as tar:
        assert sorted(tar.getnames())[:3] == ["000000000.jpg", "000000000.json", "000000000.txt"]


def test_index_is_cached_next_to_the_shard_and_rebuilt_when_it_changes(tmp_path):
    shard = tmp_path / "00000.tar"
    with tarfile.open(shard, "w") as tar:
        add(tar, "k1.txt", b"first")
    load_index(shard)
    idx = tmp_path / "00000.tar.idx.json"
    assert idx.is_file()
    assert json.loads(idx.read_text())["samples"][0][3] == "first"
    # A cached index is used as is...
    spec = json.loads(idx.read_text())
    spec["samples"][0][3] = "from the cache"
    idx.write_text(json.dumps(spec))
    assert ShardSource(str(shard)).row(0).text == "from the cache"
    # ...until the shard changes.
    with tarfile.open(shard, "w") as tar:
        add(tar, "k1.txt", b"second")
        add(tar, "k2.txt", b"third")
    os.utime(shard, ns=(1, 1))
    assert [r.text for r in ShardSource(str(shard)).rows()] == ["second", "third"]


def test_read_only_shard_folder_puts_the_index_in_the_cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    with tarfile.open(folder / "00000.tar", "w") as tar:
        add(tar, "a.txt", b"hello")
    folder.chmod(0o555)
    real_access = os.access
    # root may write anywhere; make the folder read-only for it too
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(folder) else real_access(p, mode))
    try:
        src = ShardSource(str(folder / "00000.tar"), cache_dir=tmp_path / "cache")
        assert src.row(0).text == "hello"
        assert index_path(folder / "00000.tar", tmp_path / "cache").parent == tmp_path / "cache"
        assert len(list((tmp_path / "cache").glob("*-00000.tar.idx.json"))) == 1
        assert not list(folder.glob("*.idx.json"))
    finally:
        folder.chmod(0o755)


def test_index_keeps_problems_and_drops_bad_members(tmp_path):
    shard = tmp_path / "00000.tar"
    png = io.BytesIO()
    distinct_image(3).save(png, "PNG")
    with tarfile.open(shard, "w") as tar:
        add(tar, "good.png", png.getvalue())
        add(tar, "good.txt", "café".encode())
        add(tar, "good.json", b'{"id": 42, "url": "http://x"}')
        add(tar, "latin.txt", "café".encode("latin-1"))
        add(tar, "badjson.txt", b"ok")
        add(tar, "badjson.json", b"{nope")
        add(tar, "onlyjson.json", b'{"id": "z"}')
        add(tar, "imgonly.webp", b"RIFF....")
        add(tar, "blank.png", png.getvalue())
        add(tar, "blank.txt", b"   ")
    index = build_index(shard)
    assert [s[0] for s in index["samples"]] == ["good", "imgonly", "blank"]
    assert index["samples"][0][1:4:2] == ["42", "café"]
    problems = {p[0]: (p[1], p[2]) for p in index["problems"]}
    assert "UTF-8" in problems["latin"][0] and problems["latin"][1] == "error"
    assert "not valid JSON" in problems["badjson"][0]
    assert "no image" in problems["onlyjson"][0]
    assert problems["blank"] == ("empty text (sample used as image-only)", "warning")
    src = ShardSource(str(shard))
    assert src.row(0).key == "42" and src.row(1).key == "imgonly"
    assert src.read_image(0) == png.getvalue()
    assert src.row(0).where == "00000.tar:good"


def test_missing_and_broken_shards_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match=r"2 of 2 shard\(s\) not found"):
        ShardSource(str(tmp_path / "{00000..00001}.tar"))
    (tmp_path / "00000.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(DataError, match="not a readable tar"):
        ShardSource(str(tmp_path / "00000.tar"))


def test_shard_cli_and_validate_on_the_pattern(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_manifest(tmp_path, n=5)
    r = run_cli(capsys, "data", "shard", "m.jsonl", "--out", "shards", "--shard-size", "2")
    assert r[0] == 0, r[2]
    assert "shards/{00000..00002}.tar" in r[1]
    r = run_cli(capsys, "data", "validate", "shards/{00000..00002}.tar")
    assert r[0] == 0, r[1] + r[2]
    assert "5 rows" in r[1]


def test_shard_cli_skips_unreadable_rows_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "m.jsonl", [{"image": "gone.png", "text": "x"}, {"text": "kept"}, "{bad"])
    r = run_cli(capsys, "data", "shard", "m.jsonl", "--out", "shards")
    assert r[0] == 1
    assert "wrote 1 samples" in r[1]
    assert "m.jsonl:1" in r[2] and "m.jsonl:3" in r[2]


def test_validate_a_shard_pattern_as_a_command(tmp_path, cli):
    write_shards(ManifestSource(make_manifest(tmp_path, n=3)), tmp_path / "shards", shard_size=2)
    r = cli("data", "validate", "shards/{00000..00001}.tar")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 rows (2 image-text, 1 text-only, 0 image-only); 0 error(s)" in r.stdout


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_span_walk_reads_what_tarfile_reads(tmp_path, fmt):
    """A sample's span is read by walking its headers; long names (GNU L, pax path), pax records
    and prefixes give the same members as tarfile."""
    import io
    import random

    from vltrain.data.sources.shard_scan import scan_shard, walk_members
    from vltrain.data.sources.shards import _tarfile_span, _walk_span, span_members

    rng = random.Random(fmt)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for i in range(20):
            key = "d" * rng.choice([1, 60] + ([130] if fmt != tarfile.USTAR_FORMAT else [])) + f"/k{i}"
            for ext, data in (("jpg", rng.randbytes(rng.randrange(0, 2000))), ("txt", f"cap é {i}".encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                if fmt == tarfile.PAX_FORMAT and i % 3 == 0:
                    info.pax_headers = {"comment": "x" * 300}
                tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "s.tar"
    path.write_bytes(buf.getvalue())
    scan = scan_shard(path, samples=True)
    data = path.read_bytes()
    assert len(scan.samples) == 20
    with tarfile.open(path) as tar:  # the walk finds what tarfile finds: offsets, sizes, names
        want = [(i.name, i.offset, i.offset_data, i.size) for i in tar if i.isfile()]
    assert [tuple(m) for m in walk_members(data)] == want
    for (key, _sid, _image, text, _regions), start, end in zip(scan.samples, scan.start.tolist(), scan.end.tolist()):
        span = data[start:end]
        assert _walk_span(span) == _tarfile_span(span)
        found, members = span_members(span)
        assert found == key and members["txt"].decode() == text


# -- shards with every case a scan must get right ---------------------------------------------------


def _scans(pattern: str) -> list:
    from vltrain.data.sources.shard_scan import scan_shard
    from vltrain.data.sources.shards import shard_paths

    return [scan_shard(Path(p), samples=True) for p in shard_paths(pattern)]


def _same_scans(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.samples == y.samples and x.problems == y.problems
        for name in ("start", "end", "has_image", "has_text"):
            assert getattr(x, name).tolist() == getattr(y, name).tolist(), name


def test_bulk_scan_reads_what_the_walk_and_tarfile_read(tmp_path, monkeypatch):
    """Every odd shard scans alike in bulk (where the bulk pass takes it) and header by header:
    samples, ids, image references, captions, spans and problems."""
    import mmap

    from vltrain.data.sources import shard_scan
    from vltrain.data.sources.shards import shard_paths

    pattern = odd_shards(tmp_path / "sh")
    in_bulk = []
    for p in shard_paths(pattern):
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            in_bulk.append(shard_scan._bulk(buf) is not None)
    assert [Path(p).name for p, b in zip(shard_paths(pattern), in_bulk) if b] == ["00000.tar", "00001.tar", "00009.tar"]
    bulk = _scans(pattern)
    monkeypatch.setattr(shard_scan, "_bulk", lambda buf: None)
    _same_scans(bulk, _scans(pattern))


def test_bulk_scan_of_random_shards(tmp_path, monkeypatch):
    """Random members (keys together or apart, any extension, folders, blank, odd and bad captions
    and JSON) scan alike in bulk and header by header."""
    import random

    from vltrain.data.sources import shard_scan

    rng = random.Random(11)
    texts = [b"a caption", b"", b"  ", "\u00a0".encode(), "\u2003x".encode(), b"\xff", "\u00e9t\u00e9".encode(),
             " \u3000 ".encode(), b"\n", "\u2028".encode()]
    metas = [b'{"id": "x"}', b'{"id": 3}', b"{bad", b'{"id": "\\ud800"}', b'{"id": [1]}', b'["x"]', b"",
             b'{"id": "k", "tags": ["a"]}', b'{"n": {"id": 1}}']
    for t in range(40):
        members = []
        for k in range(rng.randrange(1, 12)):
            key = rng.choice(["k", "d/k", "k.a", ""]) + f"{k}"
            exts = rng.sample(["jpg", "JPEG", "png", "webp", "txt", "json", "cls", "Txt"], rng.randrange(0, 4))
            for ext in exts:
                data = rng.choice(texts) if ext.lower() == "txt" else rng.choice(metas) if ext == "json" else b"img"
                members.append((f"{key}.{ext}", data))
            if rng.random() < 0.1:
                members.append((f"dir{k}", None))
            if rng.random() < 0.1:
                members.append((rng.choice(["x.y/README", "./d/LICENSE", ".hidden", "a/.b.txt", "noext"]), b"x"))
        if rng.random() < 0.2 and len(members) > 2:
            members.insert(0, members.pop())  # a sample's members apart
        tar_of(tmp_path / f"{t:05d}.tar", members)
    pattern = str(tmp_path / "{00000..00039}.tar")
    bulk = _scans(pattern)
    monkeypatch.setattr(shard_scan, "_bulk", lambda buf: None)
    _same_scans(bulk, _scans(pattern))


def test_whitespace_begins_with_the_bytes_the_bulk_scan_knows():
    """A caption is taken as not blank in bulk from a byte that begins no whitespace character."""
    import sys

    from vltrain.data.sources.shard_scan import _SOLID

    leads = {chr(c).encode()[0] for c in range(sys.maxunicode + 1) if chr(c).isspace()}
    assert leads and not _SOLID[sorted(leads)].any()
