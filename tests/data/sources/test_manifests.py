import pytest
from kits.datafiles import distinct_image, save, write_csv, write_jsonl

from vltrain.data.config import CsvConfig
from vltrain.data.sources.manifests import ManifestSource, refuse_malformed
from vltrain.data.sources.open import open_source
from vltrain.data.sources.patterns import expand_braces
from vltrain.errors import DataError


def test_jsonl_key_aliases_and_relative_paths(tmp_path):
    save(distinct_image(1), tmp_path / "img" / "a.png")
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"id": "x", "image": "img/a.png", "text": "one"},
            {"id": 7, "image_path": "img/a.png", "caption": "two"},
            {"filepath": "img/a.png", "title": "three"},
            {"text": "text only"},
            {"image": "img/a.png"},
        ],
    )
    src = ManifestSource(m)
    assert len(src) == 5 and not src.problems
    rows = list(src.rows())
    assert [r.text for r in rows] == ["one", "two", "three", "text only", None]
    assert [r.key for r in rows[:2]] == ["x", "7"]
    assert rows[3].image is None
    assert src.read_image(0) == (tmp_path / "img" / "a.png").read_bytes()
    assert src.has_image().tolist() == [True, True, True, False, True]
    assert rows[1].where == "m.jsonl:2"


def test_rows_sharing_an_image_are_two_samples_with_stable_distinct_keys(tmp_path):
    rows = [{"image": "same.png", "text": "a"}, {"image": "same.png", "text": "a"}]
    m = write_jsonl(tmp_path / "m.jsonl", rows)
    a, b = ManifestSource(m), ManifestSource(m)
    assert len(a) == 2
    assert a.row(0).key != a.row(1).key
    assert [r.key for r in a.rows()] == [r.key for r in b.rows()]


def test_malformed_jsonl_lines_are_reported_with_line_numbers(tmp_path):
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"text": "good"},
            "{not json",
            "[1, 2]",
            {"id": "no content"},
            {"image": 5, "text": "x"},
            {"text": ["a"]},
            b'{"text": "caf\xe9"}',  # latin-1, not UTF-8
            "",
            {"id": {"a": 1}, "text": "x"},
            {"text": "also good"},
        ],
    )
    src = ManifestSource(m)
    assert [r.text for r in src.rows()] == ["good", "also good"]
    assert [r.where for r in src.rows()] == ["m.jsonl:1", "m.jsonl:10"]
    got = {p.where: p.reason for p in src.errors()}
    assert set(got) == {"m.jsonl:2", "m.jsonl:3", "m.jsonl:4", "m.jsonl:5", "m.jsonl:6", "m.jsonl:7", "m.jsonl:9"}
    assert "not JSON" in got["m.jsonl:2"]
    assert "not a JSON object" in got["m.jsonl:3"]
    assert "no image" in got["m.jsonl:4"] and "no text" in got["m.jsonl:4"]
    assert "'image' must be a string, got int" in got["m.jsonl:5"]
    assert "'text' must be a string, got list" in got["m.jsonl:6"]
    assert "UTF-8" in got["m.jsonl:7"]
    assert "'id' must be a string or an integer" in got["m.jsonl:9"]
    with pytest.raises(DataError, match=r"7 malformed row\(s\)(.|\n)*m\.jsonl:2: not JSON(.|\n)*on_error: skip"):
        refuse_malformed(src)


def test_lone_surrogate_escapes_are_not_valid_text(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"text": "bad \\ud800 text"}\n{"text": "fine"}\n')
    src = ManifestSource(m)
    assert len(src) == 1 and "UTF-8" in src.errors()[0].reason


def test_empty_strings_are_missing_values_with_a_warning(tmp_path):
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [{"image": "a.png", "text": ""}, {"image": "", "text": "t"}, {"image": " ", "text": "  "}],
    )
    src = ManifestSource(m)
    assert [(r.image, r.text) for r in src.rows()] == [("a.png", None), (None, "t")]
    assert [(p.where, p.level) for p in src.problems] == [("m.jsonl:1", "warning"), ("m.jsonl:2", "warning"), ("m.jsonl:3", "error")]


def test_csv_and_tsv_with_configured_columns(tmp_path):
    save(distinct_image(2), tmp_path / "b.png")
    tsv = write_csv(tmp_path / "m.tsv", ["filepath", "title"], [["b.png", "a, comma"], ["", "text only"]], sep="\t")
    src = open_source(str(tsv))
    assert [(r.image, r.text) for r in src.rows()] == [("b.png", "a, comma"), (None, "text only")]
    assert src.row(0).where == "m.tsv:2"
    csv_path = write_csv(tmp_path / "m.csv", ["uid", "path", "words"], [["u1", "b.png", "x"]])
    src = open_source(str(csv_path), CsvConfig(image_key="path", text_key="words", id_key="uid"))
    assert src.row(0).key == "u1" and src.read_image(0) == (tmp_path / "b.png").read_bytes()


def test_csv_problems_have_line_numbers(tmp_path):
    p = tmp_path / "m.csv"
    p.write_bytes(b'image,text\na.png,"multi\nline caption"\nb.png,x,extra\n,\nc.png,caf\xe9\nd.png,ok\n')
    src = ManifestSource(p)
    assert [(r.where, r.text) for r in src.rows()] == [("m.csv:2", "multi\nline caption"), ("m.csv:7", "ok")]
    got = {p.where: p.reason for p in src.errors()}
    assert got.keys() == {"m.csv:4", "m.csv:5", "m.csv:6"}
    assert "3 fields" in got["m.csv:4"] and "no image" in got["m.csv:5"] and "UTF-8" in got["m.csv:6"]


def test_csv_without_usable_columns_is_refused(tmp_path):
    p = write_csv(tmp_path / "m.csv", ["foo", "bar"], [["1", "2"]])
    with pytest.raises(DataError, match="no image column.*data.csv.image_key"):
        ManifestSource(p)


def test_unknown_and_missing_sources(tmp_path):
    with pytest.raises(DataError, match="manifest not found"):
        open_source(str(tmp_path / "x.jsonl"))
    with pytest.raises(DataError, match="not a manifest"):
        open_source(str(tmp_path / "x.parquet"))


def test_brace_expansion():
    assert expand_braces("d/{00000..00002}.tar") == ["d/00000.tar", "d/00001.tar", "d/00002.tar"]
    assert expand_braces("{a,b}/{8..10}.tar") == ["a/8.tar", "a/9.tar", "a/10.tar", "b/8.tar", "b/9.tar", "b/10.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]
