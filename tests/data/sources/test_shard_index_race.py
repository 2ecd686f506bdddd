"""Many ranks opening the same shards on a fresh cache: one builds each index, the others read it."""

import multiprocessing as mp
import os
import socket

import pytest
from kits.shardkit import make_manifest

from vltrain.data.sources import shards
from vltrain.data.sources.manifests import ManifestSource
from vltrain.data.sources.shards import ShardSource, index_path, load_index, write_shards
from vltrain.errors import DataError


def _open_all(pattern, barrier, out):
    barrier.wait()  # both processes start indexing at the same moment
    src = ShardSource(pattern)
    out.put((shards.BUILDS, [(src.row(i).key, src.row(i).text) for i in range(len(src))]))


def _fresh_shards(tmp_path, n_rows=24, shard_size=3):
    written, _ = write_shards(ManifestSource(make_manifest(tmp_path, n_rows)), tmp_path / "shards", shard_size)
    for p in written:
        index_path(p, None).unlink()  # writing indexes them; start from a fresh cache
    return written


@pytest.mark.timeout(120)
def test_two_processes_racing_build_each_index_once(tmp_path):
    written = _fresh_shards(tmp_path)
    pattern = str(tmp_path / "shards" / "*.tar")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_all, args=(pattern, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=100) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sum(builds for builds, _ in results) == len(written)
    assert results[0][1] == results[1][1] and len(results[0][1]) == 24
    leftovers = [f for f in os.listdir(tmp_path / "shards") if f.endswith((".lock", ".tmp"))]
    assert leftovers == []


def test_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    (shard, *_) = _fresh_shards(tmp_path, n_rows=3)
    ctx = mp.get_context("spawn")
    dead = ctx.Process(target=int)
    dead.start()
    dead.join()
    lock = index_path(shard, None).with_name(index_path(shard, None).name + ".lock")
    lock.write_text(f"{socket.gethostname()} {dead.pid}")
    index = load_index(shard, wait_s=5)
    assert len(index["samples"]) == 3 and not lock.exists()


def test_live_lock_that_never_finishes_is_a_clear_error(tmp_path):
    (shard, *_) = _fresh_shards(tmp_path, n_rows=3)
    lock = index_path(shard, None).with_name(index_path(shard, None).name + ".lock")
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")  # a live owner that never writes
    with pytest.raises(DataError, match="delete the lock file"):
        load_index(shard, wait_s=0.3)
