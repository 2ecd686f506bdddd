"""Remote shards against a real S3-compatible server on 127.0.0.1 (moto in server mode)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import tarfile
import time

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from kits.s3kit import S3, s3, s3_server, tar_shard  # noqa: E402,F401  (fixtures)

from vltrain.config.job import load_config  # noqa: E402
from vltrain.data.sources import remote  # noqa: E402
from vltrain.data.sources.remote import RemoteReadError, expand_remote, filesystem, is_remote, stat_remote  # noqa: E402
from vltrain.data.sources.shard_cache import ShardCache  # noqa: E402
from vltrain.errors import ConfigError, DataError  # noqa: E402

FAST = {"retries": 1, "backoff_s": 0.05}
"""Retry settings that keep the failure tests short; the defaults are tested for bounds by timing."""


def cache(tmp_path, limit: int = 10**9, **kw) -> ShardCache:
    return ShardCache(tmp_path / "cache", limit, **{**FAST, **kw})


def test_is_remote():
    assert all(is_remote(u) for u in ("s3://b/k.tar", "gs://b/k", "gcs://b/k", "https://h/x.tar", "http://h/x"))
    assert not any(is_remote(p) for p in ("shards/00000.tar", "/abs/x.tar", "file:///abs/x.tar", "C:\\x.tar", ""))


def test_the_endpoint_comes_from_aws_endpoint_url_and_storage_options_override(s3):
    fs, path = filesystem("s3://bkt/a/b.tar")
    assert path == "bkt/a/b.tar" and fs.endpoint_url == s3.endpoint
    fs, _ = filesystem("s3://bkt/a/b.tar", {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"read_timeout": 7}})
    assert fs.endpoint_url == "http://127.0.0.1:9"
    assert fs.config_kwargs["read_timeout"] == 7 and fs.config_kwargs["retries"]["total_max_attempts"] == 2  # merged


def test_download_then_cache_hits_without_a_second_get(s3, tmp_path):
    s3.bucket("bkt")
    data = tar_shard(20)
    s3.put("bkt/shards/00000.tar", data)
    url = "s3://bkt/shards/00000.tar"
    c = cache(tmp_path)
    path = c.local(url)
    assert path.read_bytes() == data and c.stats.downloads == 1 and c.stats.bytes_downloaded == len(data)
    with tarfile.open(path) as tar:
        assert len(tar.getnames()) == 60
    assert c.local(url) == path and c.stats.downloads == 1 and c.stats.hits == 1
    other = cache(tmp_path)  # another worker, or the next run: finds it on disk
    assert other.local(url) == path and other.stats.downloads == 0
    s3.put("bkt/shards/00000.tar", b"y" * len(data))  # the remote is asked once per URL per process
    assert c.local(url).read_bytes() == data


def test_chunked_download_reassembles_the_object(s3, tmp_path):
    s3.bucket("bkt")
    data = os.urandom(300_000)
    s3.put("bkt/big.tar", data)
    c = cache(tmp_path, chunk_bytes=64 * 1024)  # 5 ranged GETs, several at once
    assert c.local("s3://bkt/big.tar").read_bytes() == data


def test_a_changed_object_is_fetched_again(s3, tmp_path):
    s3.bucket("bkt")
    url = "s3://bkt/00000.tar"
    s3.put("bkt/00000.tar", b"a" * 1000)
    assert cache(tmp_path).local(url).read_bytes() == b"a" * 1000
    s3.put("bkt/00000.tar", b"b" * 1000)  # same size: the ETag tells
    c = cache(tmp_path)
    assert c.local(url).read_bytes() == b"b" * 1000 and c.stats.downloads == 1
    s3.put("bkt/00000.tar", b"c" * 10)
    c = cache(tmp_path)
    assert c.local(url).read_bytes() == b"c" * 10 and c.stats.downloads == 1
    known = stat_remote(url)
    assert known["size"] == 10 and known["version"]
    c = cache(tmp_path)
    c.local(url, stat=known)
    assert c.stats.hits == 1 and c.stats.downloads == 0


def test_the_cache_stays_under_its_limit_evicting_the_least_recently_used(s3, tmp_path):
    s3.bucket("bkt")
    urls = [f"s3://bkt/{i:05d}.tar" for i in range(6)]
    for i, u in enumerate(urls):
        s3.put(u, bytes([i]) * 1000)
    c = cache(tmp_path, limit=2500)  # room for two
    held = c.open(urls[0])
    time.sleep(0.02)
    c.local(urls[1])
    time.sleep(0.02)
    c.local(urls[0])  # used again: now 1 is the least recently used
    time.sleep(0.02)
    c.local(urls[2])
    cached = {p.name for p in c.root.iterdir() if "-" in p.name}
    assert cached == {c.path_for(urls[0]).name, c.path_for(urls[2]).name}
    assert c.stats.evictions == 1
    for u in urls[3:]:
        time.sleep(0.02)
        c.local(u)
        assert c.usage() <= 2500
    assert c.local(urls[5]).exists() and not c.path_for(urls[0]).exists()
    assert held.read() == bytes([0]) * 1000  # an open file outlives its eviction
    held.close()
    big = cache(tmp_path, limit=500)  # one object over the limit is still kept while it is used
    assert big.local(urls[1]).read_bytes() == bytes([1]) * 1000


def _fetch_in_child(c: ShardCache, url: str, start, out) -> None:
    before = c.stats.downloads  # inherited from the parent
    start.wait(10)
    path = c.local(url)
    out.put((c.stats.downloads - before, path.read_bytes() == tar_shard(200, seed=3)))


def test_two_processes_asking_at_once_download_once(s3, tmp_path):
    s3.bucket("bkt")
    s3.put("bkt/00003.tar", tar_shard(200, seed=3))
    s3.put("bkt/warm.tar", b"w")
    c = cache(tmp_path, chunk_bytes=64 * 1024)
    c.local("s3://bkt/warm.tar")  # the parent's client and threads exist before the fork
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_child, args=(c, "s3://bkt/00003.tar", start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    assert sorted(d for d, _ in results) == [0, 1] and all(ok for _, ok in results)


def test_a_lock_left_by_a_dead_process_is_taken_over(s3, tmp_path):
    s3.bucket("bkt")
    s3.put("bkt/x.tar", b"x" * 100)
    c = cache(tmp_path, lock_wait_s=5)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = c.path_for("s3://bkt/x.tar").with_name(c.path_for("s3://bkt/x.tar").name.split("-")[0] + ".lock")
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{socket.gethostname()} {dead.pid}")
    assert c.local("s3://bkt/x.tar").read_bytes() == b"x" * 100 and not lock.exists()


def test_missing_bucket_and_key_name_the_url(s3, tmp_path):
    s3.bucket("bkt")
    c = cache(tmp_path)
    for url in ("s3://nobucket/00000.tar", "s3://bkt/missing.tar"):
        for call in (lambda: c.local(url), lambda: stat_remote(url)):
            with pytest.raises(DataError, match=url) as e:
                call()
            assert "AWS_ENDPOINT_URL" in str(e.value) or s3.endpoint in str(e.value)
    with pytest.raises(RemoteReadError, match="s3://bkt/missing.jpg"):  # a per-sample read: a bad sample
        c.read_bytes("s3://bkt/missing.jpg")
    s3.put("bkt/a.jpg", b"jpeg")
    assert c.read_bytes("s3://bkt/a.jpg") == b"jpeg" and c.stats.downloads == 0


def test_network_errors_mid_download_are_retried_then_reported(s3, tmp_path, monkeypatch):
    s3.bucket("bkt")
    data = os.urandom(200_000)
    s3.put("bkt/00000.tar", data)
    c = cache(tmp_path, chunk_bytes=50_000, retries=2)
    fs, _ = filesystem("s3://bkt/00000.tar")
    real, calls = fs.cat_file, []

    def flaky(path, start=None, end=None, **kw):
        calls.append(start)
        if calls.count(start) == 1 and start == 100_000:
            raise ConnectionResetError("connection reset by peer")
        return real(path, start=start, end=end, **kw)

    monkeypatch.setattr(fs, "cat_file", flaky)
    assert c.local("s3://bkt/00000.tar").read_bytes() == data and calls.count(100_000) == 2

    def broken(path, start=None, end=None, **kw):
        raise TimeoutError("read timed out")

    monkeypatch.setattr(fs, "cat_file", broken)
    s3.put("bkt/00001.tar", data)
    with pytest.raises(RemoteReadError, match="s3://bkt/00001.tar.*3 attempts"):
        c.local("s3://bkt/00001.tar")
    assert not [p for p in c.root.iterdir() if p.name.endswith(".tmp")]  # no partial file left
    assert not c.path_for("s3://bkt/00001.tar").exists()


ONE_TRY = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
"""botocore's own attempts cut to one, so a failure test takes a second, not the default ~15 s."""


def test_a_stopped_server_is_an_error_within_bounded_time_not_a_hang(tmp_path, monkeypatch):
    server = S3()
    server.env(monkeypatch)
    server.bucket("offline")  # moto's state is per process: a name no other test uses
    server.put("offline/a.tar", b"a" * 100)
    server.put("offline/b.tar", b"b" * 100)
    c = ShardCache(tmp_path / "cache", 10**6, ONE_TRY, **FAST)
    known = {u: stat_remote(u) for u in ("s3://offline/a.tar", "s3://offline/b.tar")}
    c.local("s3://offline/a.tar")
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(DataError, match="s3://offline/c.tar"):
        stat_remote("s3://offline/c.tar", ONE_TRY, **FAST)
    with pytest.raises(RemoteReadError, match="s3://offline/b.tar.*2 attempts"):
        c.local("s3://offline/b.tar", stat=known["s3://offline/b.tar"])
    with pytest.raises(RemoteReadError, match=server.endpoint):
        c.read_bytes("s3://offline/a.tar")
    assert time.monotonic() - t0 < 10
    cached = c.local("s3://offline/a.tar", stat=known["s3://offline/a.tar"])  # needs no server
    assert cached.read_bytes() == b"a" * 100


def test_a_server_that_never_answers_times_out(tmp_path, monkeypatch):
    """A connection accepted and then left silent: the read timeout ends each attempt."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    options = {"endpoint_url": endpoint, "config_kwargs": {"read_timeout": 1, "connect_timeout": 1,
                                                           "retries": {"total_max_attempts": 1}}}
    c = ShardCache(tmp_path / "cache", 10**6, options, **FAST)
    t0 = time.monotonic()
    try:
        with pytest.raises(RemoteReadError, match="s3://bkt/a.tar"):
            c.local("s3://bkt/a.tar", stat={"size": 100, "version": "x"})
        with pytest.raises(DataError, match="s3://bkt/a.tar"):
            stat_remote("s3://bkt/a.tar", options, **FAST)
    finally:
        silent.close()
    assert time.monotonic() - t0 < 15


def test_expand_remote_braces_and_globs(s3):
    s3.bucket("bkt")
    for i in range(5):
        s3.put(f"bkt/train/{i:05d}.tar", b"t")
    s3.put("bkt/train/notes.txt", b"n")
    s3.put("bkt/val/00000.tar", b"v")
    assert expand_remote("s3://bkt/train/{00000..00002}.tar") == [f"s3://bkt/train/{i:05d}.tar" for i in range(3)]
    assert expand_remote("s3://bkt/train/*.tar") == [f"s3://bkt/train/{i:05d}.tar" for i in range(5)]
    assert expand_remote("s3://bkt/{val,train}/0000[04].tar") == [
        "s3://bkt/val/00000.tar", "s3://bkt/train/00000.tar", "s3://bkt/train/00004.tar"]
    with pytest.raises(DataError, match="s3://bkt/test/\\*.tar"):
        expand_remote("s3://bkt/test/*.tar")
    with pytest.raises(DataError, match="brace"):
        expand_remote("https://example.invalid/shards/*.tar")


def test_prefetch_downloads_ahead_a_bounded_number(s3, tmp_path):
    s3.bucket("bkt")
    urls = [f"s3://bkt/{i:05d}.tar" for i in range(4)]
    for u in urls:
        s3.put(u, b"p" * 5000)
    c = cache(tmp_path, ahead=2)
    assert c.prefetch(urls) == 2
    assert c.local(urls[0]).exists() and c.local(urls[1]).exists()
    assert c.stats.downloads == 2 and c.stats.hits == 2
    assert c.prefetch(urls[2:]) == 2
    assert c.local(urls[2]).exists() and c.local(urls[3]).exists()  # each waits for its prefetch
    assert c.stats.downloads == 4 and c.stats.hits == 4 and c.stats.prefetch_errors == 0
    assert c.prefetch(["s3://bkt/missing.tar"]) == 1
    with pytest.raises(DataError, match="missing.tar"):
        c.local("s3://bkt/missing.tar")
    assert c.stats.prefetch_errors == 1
    c.close()


def test_a_cache_pickles_for_spawned_workers(s3, tmp_path):
    s3.bucket("bkt")
    s3.put("bkt/a.tar", b"a")
    c = cache(tmp_path)
    c.prefetch(["s3://bkt/a.tar"])
    copy = pickle.loads(pickle.dumps(c))
    assert copy.local("s3://bkt/a.tar").read_bytes() == b"a"
    c.close()


def test_config_keys():
    cfg = load_config(None, ["data.storage_options={endpoint_url: 'http://127.0.0.1:9000', anon: true}",
                             "data.cache_limit_gb=0.5"])
    assert cfg.data.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "anon": True}
    assert cfg.data.cache_limit_gb == 0.5
    with pytest.raises(ConfigError, match="cache_limit_gb"):
        load_config(None, ["data.cache_limit_gb=0"])
    with pytest.raises(DataError):
        ShardCache("/tmp", 0)
    assert remote.default_options("https")["client_kwargs"]["timeout"].sock_read == remote.READ_TIMEOUT_S
