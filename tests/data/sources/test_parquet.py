import numpy as np
import pytest
from kits.parquetkit import hub_parquet, img2dataset_parquet, shapes
from kits.s3kit import evict_after_lookup, s3, s3_server  # noqa: F401  (fixtures)

from vltrain.data.config import CsvConfig
from vltrain.data.index.open import open_indexed
from vltrain.data.sources.parquet import is_parquet
from vltrain.errors import DataError

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """12 shapes in 3 Hub-style files of 4 rows, 2 rows per row group, written by ``datasets``."""
    pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hub")
    pairs = shapes(12)
    return root, pairs, hub_parquet(root, pairs, files=3, row_group=2, text_column="caption")


def test_hub_parquet_rows_come_back_in_order_with_their_images(hub):
    root, pairs, files = hub
    source = open_indexed(str(root / "data" / "train-{00000..00002}-of-00003.parquet"), None, 77)
    assert source.kind == "parquet" and len(source) == 12
    assert source.meta["parquet"]["image_kind"] == "struct"
    for i, (data, caption) in enumerate(pairs):
        assert source.row(i).text == caption
        assert source.read_image(i) == data
    assert source.row(5).key == "train-00001-of-00003:0:1"  # file, row group, row: stable
    # the shuffle's blocks are the row groups: 2 rows each
    assert source.blocks().tolist() == list(range(0, 13, 2))
    assert source.has_image().all() and source.has_text().all()
    globbed = open_indexed(str(root / "data" / "train-*.parquet"), None, 77)
    assert globbed.files == source.files and len(globbed) == 12


def test_rows_are_read_in_any_order_and_after_pickling(hub):
    import pickle

    root, pairs, _ = hub
    source = open_indexed(str(root / "data" / "train-00001-of-00003.parquet"), None, 77)
    order = [3, 0, 2, 1, 3]
    assert [source.read_image(i) for i in order] == [pairs[4 + i][0] for i in order]
    copy = pickle.loads(pickle.dumps(source))
    assert copy.row(2).text == pairs[6][1]


def test_img2dataset_layout_drops_failed_downloads_and_counts_them(tmp_path):
    pairs = shapes(10, seed=1, fmt="JPEG")
    path = img2dataset_parquet(tmp_path / "00000.parquet", pairs, failed=(2, 7), row_group=4)
    source = open_indexed(str(path), None, 77)
    spec = source.meta["parquet"]
    assert (spec["image"], spec["image_kind"], spec["text"], spec["id"]) == ("jpg", "binary", "caption", "key")
    assert len(source) == 8
    kept = [i for i in range(10) if i not in (2, 7)]
    assert [source.row(i).key for i in range(8)] == [f"{k:09d}" for k in kept]
    assert [source.read_image(i) for i in range(8)] == [pairs[k][0] for k in kept]
    assert [str(p) for p in source.problems] == ["00000.parquet: 2 row(s) without an image skipped: img2dataset "
                                                 "status is not 'success'"]
    assert source.error_count() == 0


def test_image_paths_are_relative_to_the_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = shapes(3, seed=2)
    (tmp_path / "imgs").mkdir()
    for i, (data, _) in enumerate(pairs):
        (tmp_path / "imgs" / f"{i}.png").write_bytes(data)
    pq.write_table(pa.table({"file": [f"imgs/{i}.png" for i in range(3)], "text": [c for _, c in pairs]}),
                   tmp_path / "t.parquet")
    source = open_indexed(str(tmp_path / "t.parquet"), None, 77, CsvConfig(image_key="file"))
    assert source.meta["parquet"]["image_kind"] == "path"
    assert [source.read_image(i) for i in range(3)] == [d for d, _ in pairs]


def test_bad_parquet_input_gets_one_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [1], "b": ["x"]}), tmp_path / "none.parquet")
    with pytest.raises(DataError, match=r"none.parquet: columns \['a', 'b'\] hold no image"):
        open_indexed(str(tmp_path / "none.parquet"), None, 77)
    with pytest.raises(DataError, match=r"1 of 2 file\(s\) not found"):
        open_indexed(str(tmp_path / "{none,gone}.parquet"), None, 77)
    pq.write_table(pa.table({"image": [b"x"], "text": ["x"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"other": [b"x"], "text": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: no column \['image'\]"):
        open_indexed(str(tmp_path / "{a,b}.parquet"), None, 77)
    # a file cut off (no footer) after a good one: skipped, counted, the good one kept
    pq.write_table(pa.table({"image": [b"x"], "text": ["x"]}), tmp_path / "d.parquet")
    (tmp_path / "c.parquet").write_bytes((tmp_path / "d.parquet").read_bytes()[:-20])
    source = open_indexed(str(tmp_path / "{c,d}.parquet"), None, 77)  # the damaged one first
    assert len(source) == 1 and source.error_count() == 1
    assert str(source.problems[0]).startswith("c.parquet: damaged parquet: not readable (")
    assert [(d["where"], d["kept"], d["lost"], d["exact"]) for d in source.damaged] == [("c.parquet", 0, 0, False)]


def test_a_damaged_row_group_is_skipped_and_counted(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [b"img%d" % i for i in range(9)], "text": [f"caption {i}" for i in range(9)]}),
                   path, row_group_size=3, compression="snappy")
    column = pq.ParquetFile(path).metadata.row_group(1).column(1)  # row group 1's text chunk
    data = bytearray(path.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))
    source = open_indexed(str(path), None, 77)
    assert [source.row(i).text for i in range(len(source))] == [f"caption {i}" for i in (0, 1, 2, 6, 7, 8)]
    assert source.error_count() == 1
    assert str(source.problems[0]).startswith("t.parquet:row group 1: damaged parquet: row group 1 unreadable (")
    assert str(source.problems[0]).endswith("; 6 rows of the file kept, 3 lost")
    assert [(d["kept"], d["lost"], d["exact"]) for d in source.damaged] == [(6, 3, True)]


def test_is_parquet():
    assert is_parquet("data/train-{00000..00003}-of-00004.parquet") and is_parquet("s3://b/x.PARQUET")
    assert not is_parquet("shards/{00000..00003}.tar") and not is_parquet("train.jsonl")


def test_remote_parquet_is_cached_whole_and_reads_like_local(hub, s3, tmp_path):
    root, pairs, files = hub
    s3.fs.mkdir("bucket")
    for f in files:
        s3.fs.put(str(f), f"bucket/hub/{f.name}")
    source = open_indexed("s3://bucket/hub/train-{00000..00002}-of-00003.parquet", None, 77,
                          cache_dir=tmp_path / "cache")
    assert source.cache is not None and len(source) == 12
    source.prefetch(np.arange(12))
    assert [source.read_image(i) for i in range(12)] == [d for d, _ in pairs]
    assert [source.row(i).text for i in range(12)] == [c for _, c in pairs]
    listed = open_indexed("s3://bucket/hub/train-*.parquet", None, 77, cache_dir=tmp_path / "cache")  # a glob
    assert listed.files == source.files and [listed.row(i).text for i in range(12)] == [c for _, c in pairs]


def test_a_remote_parquet_file_evicted_between_its_lookup_and_its_open_is_fetched_again(hub, s3, tmp_path):
    """As for tar shards: another process's download evicts the file a reader has just found in
    the cache, before pyarrow opens it. The row must still read, not be replaced in this run only."""
    from vltrain.data.sources.shard_cache import ShardCache

    root, pairs, files = hub
    s3.fs.mkdir("bucket")
    for f in files:
        s3.fs.put(str(f), f"bucket/hub/{f.name}")
    cache_dir = tmp_path / "cache"
    limit = int(1.5 * max(f.stat().st_size for f in files))
    source = open_indexed("s3://bucket/hub/train-{00000..00002}-of-00003.parquet", None, 77,
                          cache_dir=cache_dir, cache_limit_gb=limit / 2**30)
    evict_after_lookup(source.cache, ShardCache(cache_dir, limit), source.files[0], source.files[2])
    assert source.read_image(0) == pairs[0][0]
    assert source.cache.raced


def test_the_data_tools_read_parquet(hub, capsys, tmp_path):
    import json
    import tarfile

    from kits.datafiles import run_cli

    root, pairs, _ = hub
    pattern = str(root / "data" / "train-{00000..00002}-of-00003.parquet")
    code, out, err = run_cli(capsys, "data", "validate", pattern, "--json", "--workers", "1")
    report = json.loads(out)
    assert code == 0, err
    assert report["sources"][0]["rows"] == 12 and report["sources"][0]["image_text"] == 12
    code, out, _ = run_cli(capsys, "data", "stats", pattern, "--json")
    assert code == 0 and json.loads(out)["image_text"] == 12 and json.loads(out)["image_width"]["max"] == 32
    code, out, _ = run_cli(capsys, "data", "index", pattern)
    assert code == 0 and "12" in out
    code, _, err = run_cli(capsys, "tokenizer", "train", pattern, "--out", tmp_path / "tok.json", "--vocab-size", "200")
    assert code == 0, err
    assert (tmp_path / "tok.json").is_file()
    code, out, err = run_cli(capsys, "data", "shard", pattern, "--out", tmp_path / "shards", "--shard-size", "5")
    assert code == 0, err
    assert out.startswith("wrote 12 samples in 3 shard(s)")
    with tarfile.open(tmp_path / "shards" / "00000.tar") as tar:
        names = tar.getnames()
        assert names[:3] == ["000000000.png", "000000000.txt", "000000000.json"]
        assert tar.extractfile(names[0]).read() == pairs[0][0]  # copied as it is: no re-encoding


def test_validate_names_a_damaged_parquet_file(tmp_path, capsys):
    from kits.datafiles import run_cli

    (tmp_path / "t.parquet").write_bytes(b"PAR1 cut off")
    code, out, err = run_cli(capsys, "data", "validate", tmp_path / "t.parquet")
    assert code == 1 and "t.parquet: not a readable parquet file" in out + err and "Traceback" not in err


def test_parquet_in_a_weighted_mixture_with_budget_batches(hub, tmp_path):
    from vltrain.data.config import DataConfig, SourceSpec
    from vltrain.data.dataset import build_dataset
    from vltrain.data.loading.loader import build_train_loader
    from vltrain.data.tools.tokenizer_training import train_tokenizer

    root, pairs, _ = hub
    i2d = img2dataset_parquet(tmp_path / "00000.parquet", shapes(10, seed=3, fmt="JPEG"), failed=(4,), row_group=3)
    tok = train_tokenizer(iter([c for _, c in pairs]), tmp_path / "tok.json", vocab_size=200)
    cfg = DataConfig(train=[SourceSpec(str(root / "data" / "train-{00000..00002}-of-00003.parquet"), 2.0),
                            SourceSpec(str(i2d))],
                     image_size=16, max_text_length=16, batch_size=4, batching="budget", epoch_size=30,
                     num_workers=0, pin_memory=False)
    ds = build_dataset(cfg, "train", tok, plan_aware=True)
    assert len(ds) == 12 + 9
    sources, ids = [], []
    for rank in (0, 1):
        loader = build_train_loader(cfg, ds, rank=rank, world_size=2, seed=0, run_dir=None, pad_id=tok.pad_id)
        it = iter(loader)
        for _ in range(len(loader)):
            b = next(it)
            assert b.images.pixels.shape[1:] == (3, 16, 16) and int(b.input_ids.ne(tok.pad_id).sum(1).min()) > 0
            sources += b.source.tolist()
            ids += b.ids.tolist()
    assert len(ids) >= 30
    # 2:1 per row over 12 and 9 rows: 24/33 of the epoch from the Hub files
    assert abs(sources.count(0) / len(sources) - 24 / 33) < 0.1, sources


def test_an_image_chunk_damaged_after_indexing_is_a_bad_sample(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [b"img%d" % i for i in range(6)], "text": [f"caption {i}" for i in range(6)]}),
                   path, row_group_size=3)
    source = open_indexed(str(path), None, 77)  # the build reads no image: statistics say none is missing
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))
    assert source.read_image(0) == b"img0"
    with pytest.raises(OSError):  # what the dataset replaces and logs as a bad sample
        source.read_image(4)


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    import sys

    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"pip install 'vltrain\[parquet\]'"):
        open_indexed(str(tmp_path / "t.parquet"), None, 77)


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_row_group_blocks_are_the_same_whatever_the_chunk(chunk):
    from vltrain.data.index.reader import _group_starts

    file = np.array([0, 0, 0, 1, 1, 1, 1, 2], np.uint32)
    group = np.array([0, 0, 1, 0, 0, 1, 1, 0], np.uint32)
    assert _group_starts(file, group, chunk).tolist() == [0, 2, 3, 5, 7, 8]
    assert _group_starts(file[:0], group[:0], chunk).tolist() == [0]
