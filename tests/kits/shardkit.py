"""Shards for the tests: a small manifest to shard, and shards with every odd member, caption,
metadata and header the scans must read as ``tarfile`` would."""

import io
import json
import tarfile

from kits.datafiles import distinct_image, save, write_jsonl


def make_manifest(tmp_path, n=7):
    rows = []
    for i in range(n):
        row = {"id": f"s{i}", "text": f"caption {i}"}
        if i % 3 != 2:
            row["image"] = str(save(distinct_image(i), tmp_path / "img" / f"{i}.{'png' if i % 2 else 'jpg'}"))
        rows.append(row)
    return write_jsonl(tmp_path / "m.jsonl", rows)


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _patched(header: bytes, at: int, field: bytes) -> bytes:
    """A tar header with ``field`` written at ``at`` and its checksum made right again."""
    out = bytearray(header)
    out[at : at + len(field)] = field
    out[148:156] = b" " * 8
    out[148:155] = b"%06o\0" % sum(out)
    return bytes(out)


def _raw_member(name: str, data: bytes, size_field: bytes | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    head = info.tobuf(tarfile.GNU_FORMAT)
    if size_field is not None:
        head = _patched(head, 124, size_field)
    return head + data + bytes(-len(data) % 512)


def tar_of(path, members, fmt=tarfile.GNU_FORMAT) -> None:
    with tarfile.open(fileobj=path, mode="w", format=fmt) if isinstance(path, io.BytesIO) else \
            tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            if data is None:
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                add(tar, name, data)


def odd_shards(folder) -> str:
    """Shards 00000-00011 (a pattern): plain samples in bulk, then every odd case of member, caption,
    metadata and header that the scan must read as ``tarfile`` would."""
    import random

    rng = random.Random(7)
    folder.mkdir(parents=True, exist_ok=True)
    plain = []
    for i in range(300):
        ext = ("jpg", "png", "jpeg", "webp")[i % 4]
        plain.append((f"{i:06d}.{ext}", rng.randbytes(rng.randrange(0, 1500))))
        plain.append((f"{i:06d}.txt", f"caption {i} é".encode()))
        if i % 3 == 0:
            plain.append((f"{i:06d}.json", json.dumps({"id": f"id-{i}", "url": "http://x/%d" % i}).encode()))
    tar_of(folder / "00000.tar", plain)
    odd = [("up.JPG", b"img"), ("up.TXT", b"upper"), ("both.png", b"png"), ("both.jpeg", b"jpeg"),
           ("both.txt", b"two images"), ("textonly.txt", b"only text"), ("jsononly.json", b'{"id": "j"}'),
           ("blank.jpg", b"i"), ("blank.txt", b" \t\n"), ("blanknoimg.txt", b"   "),
           ("nbsp.jpg", b"i"), ("nbsp.txt", "\u00a0\u3000".encode()), ("cjk.txt", "日本語".encode()),
           ("dash.txt", "\u2013".encode()), ("latin.jpg", b"i"), ("latin.txt", "café".encode("latin-1")),
           ("cont.txt", b"\xa9abc"), ("empty.jpg", b"i"), ("empty.txt", b""), ("emptyjson.txt", b"t"),
           ("emptyjson.json", b""), ("badjson.txt", b"t"), ("badjson.json", b"{nope"),
           ("list.txt", b"t"), ("list.json", b'["x"]'), ("arrid.txt", b"t"), ("arrid.json", b'{"id": [1]}'),
           ("boolid.txt", b"t"), ("boolid.json", b'{"id": true}'), ("intid.txt", b"t"), ("intid.json", b'{"id": 5}'),
           ("surr.txt", b"t"), ("surr.json", b'{"id": "\\ud800"}'), ("esc.txt", b"t"),
           ("esc.json", b'{"id": "caf\\u00e9"}'), ("pretty.txt", b"t"), ("pretty.json", b'{\n  "id": "p"\n}\n'),
           ("tags.txt", b"t [sic]"), ("tags.json", b'{"id": "g", "tags": ["a", "b"]}'),
           ("space.txt", b"t"), ("space.json", b' {"id": "s"}'), ("two.txt", b"t"),
           ("two.json", b'{"id": "a"}, {"id": "b"}'), ("nested.txt", b"t"), ("nested.json", b'{"m": {"id": 1}}'),
           ("dir", None), ("dir/inner.jpg", b"i"), ("dir/inner.txt", b"in a folder"), ("README", b"no dot"),
           (".hidden.txt", b"hidden"), ("seg.seg.png", b"i"), ("seg.txt", b"dotted"), ("other.cls", b"3"),
           ("tail.jpg", b"i")]
    tar_of(folder / "00001.tar", odd)
    tar_of(folder / "00002.tar", [("a.jpg", b"a"), ("b.jpg", b"b"), ("a.txt", b"apart"), ("b.txt", b"bee")])
    tar_of(folder / "00003.tar", [("k.jpg", b"1"), ("k.txt", b"t"), ("k.JPG", b"2"), ("m.txt", b"m")])
    tar_of(folder / "00004.tar", [("p" * 120 + ".jpg", b"x"), ("p" * 120 + ".txt", b"long"), ("q.txt", b"q")],
         tarfile.PAX_FORMAT)
    tar_of(folder / "00005.tar", [("l" * 120 + ".jpg", b"x"), ("l" * 120 + ".txt", b"long"), ("r.txt", b"r")])
    tar_of(folder / "00006.tar", [("d" * 90 + "/" + "e" * 60 + ".txt", b"prefix"), ("s.txt", b"s")],
         tarfile.USTAR_FORMAT)
    inner = io.BytesIO()
    tar_of(inner, [("inner.txt", b"inside")])
    tar_of(folder / "00007.tar", [("outer.tar", inner.getvalue()), ("outer.txt", b"holds a tar")])
    members = [_raw_member("sp.txt", b"space", b"%011o " % 5), _raw_member("lead.txt", b"lead", b"   %08o\0" % 4),
               _raw_member("b256.txt", b"base", b"\x80" + (4).to_bytes(11, "big"))]
    (folder / "00008.tar").write_bytes(b"".join(members) + bytes(1024))
    (folder / "00009.tar").write_bytes(b"".join(members[:1]) + bytes(1024))
    (folder / "00010.tar").write_bytes(bytes(10240))
    (folder / "00011.tar").write_bytes(_raw_member("z.txt", b"zed") + bytes(1024) + _raw_member("y.txt", b"after"))
    return str(folder / "{00000..00011}.tar")
