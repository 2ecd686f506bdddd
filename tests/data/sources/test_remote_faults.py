"""The remote reader when the machine misbehaves: a cache limit that holds with evicted files
still being read, and a storage outage in the middle of reading (moto server, real processes)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from kits.multiproc import free_port  # noqa: E402
from kits.s3kit import S3, evict_after_lookup, s3, s3_server, tar_shard  # noqa: E402,F401  (fixtures)

from vltrain.data.index.open import open_indexed  # noqa: E402
from vltrain.data.schedule.sampler import LOOKAHEAD  # noqa: E402
from vltrain.data.sources.remote import RemoteReadError  # noqa: E402

SHARDS, ROWS, IMAGE_BYTES = 40, 20, 30_000


def upload(s3: S3, bucket: str = "bkt") -> tuple[str, int]:
    s3.bucket(bucket)
    sizes = []
    for k in range(SHARDS):
        data = tar_shard(ROWS, seed=k, image_bytes=IMAGE_BYTES)
        s3.put(f"s3://{bucket}/shards/{k:05d}.tar", data)
        sizes.append(len(data))
    return f"s3://{bucket}/shards/{{00000..{SHARDS - 1:05d}}}.tar", max(sizes)


class Images(torch.utils.data.Dataset):
    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> int:
        return len(self.source.read_image(i))


def held_on_disk(cache_dir: Path, pids: list[int]) -> tuple[int, int]:
    """Bytes of the files in the shard cache (downloads in progress included), and of deleted
    files in it that ``pids`` hold open."""
    remote = cache_dir / "remote"
    in_dir = 0
    for p in remote.iterdir() if remote.is_dir() else []:
        with contextlib.suppress(FileNotFoundError):
            in_dir += p.stat().st_size
    deleted, seen = 0, set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir() if fds.is_dir() else []:
            try:
                target = os.readlink(fd)
                if target.startswith(str(remote)) and target.endswith("(deleted)"):
                    st = os.stat(fd)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        deleted += st.st_size
            except FileNotFoundError:
                continue
    return in_dir, deleted


class WindowedBatches:
    """Batches of ROWS rows from windows of ``window`` shards shuffled together, asking for the
    shards of the batch LOOKAHEAD steps ahead as each is yielded: the trainer's order and
    prefetch (the sampler runs in the training process), on shards of ROWS rows."""

    def __init__(self, source, window: int):
        rng = np.random.default_rng(0)
        order = rng.permutation(SHARDS)
        rows = np.concatenate([rng.permutation(np.concatenate([np.arange(k * ROWS, (k + 1) * ROWS) for k in
                                                               order[w : w + window]]))
                               for w in range(0, SHARDS, window)])
        self.source, self.batches = source, np.split(rows, SHARDS)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for k, batch in enumerate(self.batches):
            if k + LOOKAHEAD < len(self.batches):
                self.source.prefetch(self.batches[k + LOOKAHEAD])
            yield batch.tolist()


class DiskWatch(threading.Thread):
    """The most the shard cache held on the disk, deleted-but-open files included, and the most
    deleted-but-open files alone, sampled every few milliseconds while ``pids`` run."""

    def __init__(self, cache_dir: Path, pids: list[int]):
        super().__init__(daemon=True)
        self.cache_dir, self.pids, self.worst, self.done = cache_dir, pids, (0, 0), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            in_dir, deleted = held_on_disk(self.cache_dir, self.pids)
            self.worst = (max(self.worst[0], in_dir + deleted), max(self.worst[1], deleted))
            time.sleep(0.002)

    def stop(self) -> tuple[int, int]:
        self.done.set()
        self.join()
        return self.worst


@pytest.mark.slow
def test_the_cache_holds_the_limit_plus_one_shard_per_process_and_download(s3, tmp_path):
    """docs/formats.md's bound, with real loader workers: 2 workers read windows of 12 shards,
    the training process fetches ahead, and it waits between batches (a training step), so the
    workers sit with their queues full while the downloads ahead evict what they read. Disk
    held, deleted-but-open files included, at most: the limit, plus per worker and for the
    training process one shard (held open, or being downloaded), plus the downloads ahead."""
    pattern, shard = upload(s3)
    limit = 12 * shard
    cache_dir = tmp_path / "cache"
    source = open_indexed(pattern, None, 16, cache_dir=cache_dir, cache_limit_gb=limit / 2**30)
    for p in (cache_dir / "remote").iterdir():  # built the index: start with an empty cache
        p.unlink()
    workers = 2
    loader = torch.utils.data.DataLoader(Images(source), batch_sampler=WindowedBatches(source, 12),
                                         num_workers=workers, prefetch_factor=2)
    it = iter(loader)
    watch = DiskWatch(cache_dir, [os.getpid(), *(w.pid for w in it._workers)])
    watch.start()
    total = 0
    for batch in it:
        total += int(batch.sum())
        time.sleep(0.05)
    worst, deleted = watch.stop()
    assert total == SHARDS * ROWS * IMAGE_BYTES  # every image read whole
    processes = workers + 1
    assert deleted <= processes * shard, f"{deleted / shard:.2f} shards deleted but held open by {processes} processes"
    bound = limit + (processes + source.cache.ahead) * shard
    assert worst <= bound, f"held {worst / shard:.2f} shards on disk, limit {limit / shard:.0f}, bound {bound / shard:.0f}"


def test_a_shard_evicted_while_open_is_closed_and_downloaded_again(s3, tmp_path):
    pattern, shard = upload(s3)
    source = open_indexed(pattern, None, 16, cache_dir=tmp_path / "cache", cache_limit_gb=3 * shard / 2**30)
    rows_of = source.blocks()
    first = source.read_image(0)
    for k in range(1, 6):  # five other shards push the first one out of the cache
        source.read_image(int(rows_of[k]))
    assert held_on_disk(tmp_path / "cache", [os.getpid()])[1] == 0  # no evicted file held open
    downloads = source.cache.stats.downloads
    assert source.read_image(0) == first  # the schedule comes back to it: fetched again
    assert source.cache.stats.downloads == downloads + 1


def test_a_shard_evicted_between_its_lookup_and_its_open_is_fetched_again(s3, tmp_path):
    """Another rank's download can evict the shard a worker has just found in the cache, before
    the worker opens it: the read must still succeed, not fail (the sample would be replaced in
    this run only, and a resumed run would differ from the uninterrupted one)."""
    from vltrain.data.sources.shard_cache import ShardCache

    pattern, shard = upload(s3)
    cache_dir = tmp_path / "cache"
    source = open_indexed(pattern, None, 16, cache_dir=cache_dir, cache_limit_gb=1.5 * shard / 2**30)
    other = ShardCache(cache_dir, source.cache.limit_bytes)  # another process on the same cache
    evict_after_lookup(source.cache, other, source.files[0], source.files[3])
    assert source.read_image(0) == bytes([0]) * IMAGE_BYTES  # tar_shard's image of row 0, shard 0
    assert source.cache.raced


def test_local_descriptors_stay_open(tmp_path):
    from vltrain.data.sources.shards import write_shards  # noqa: F401  (local data: never deleted)

    shard = tmp_path / "00000.tar"
    shard.write_bytes(tar_shard(ROWS, image_bytes=100))
    source = open_indexed(str(shard), None, 16, cache_dir=tmp_path / "cache")
    source.read_image(0)
    fd = source._fds[str(shard)]
    source.read_image(ROWS - 1)
    assert source._fds[str(shard)] == fd


def _outage_source(server: S3, tmp_path: Path, bucket: str):
    pattern, shard = upload(server, bucket)
    source = open_indexed(pattern, None, 16, cache_dir=tmp_path / "cache", cache_limit_gb=4 * shard / 2**30)
    return source, source.blocks()


def test_an_outage_mid_run_names_the_url_endpoint_and_retries_within_the_timeouts(tmp_path, monkeypatch):
    server = S3()
    server.env(monkeypatch)
    source, rows_of = _outage_source(server, tmp_path, "outage-a")
    source.read_image(0)
    server.stop()
    source.cache.retries, source.cache.backoff_s = 1, 0.1
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError) as e:
        source.read_image(int(rows_of[5]))  # a shard not on the disk
    assert time.monotonic() - t0 < 30
    assert "s3://outage-a/shards/00005.tar" in str(e.value)
    assert server.endpoint in str(e.value) and "2 attempts" in str(e.value)
    assert source.read_image(1)  # what is on the disk reads on


def test_a_server_back_before_the_retries_run_out_loses_no_sample(tmp_path, monkeypatch):
    server = S3()
    server.env(monkeypatch)
    source, rows_of = _outage_source(server, tmp_path, "outage-b")
    want = [source.read_image(int(rows_of[k])) for k in (5, 6)]
    source.cache.stats.downloads = 0
    for p in (tmp_path / "cache" / "remote").iterdir():
        p.unlink()
    source._fds.clear()
    server.stop()
    source.cache.retries, source.cache.backoff_s = 4, 1.0  # waits 1 + 2 + 4 + 8 s in all
    restarted = threading.Timer(1.5, lambda: _restart(server))
    restarted.start()
    try:
        got = [source.read_image(int(rows_of[k])) for k in (5, 6)]
    finally:
        restarted.join()
        server.stop()
    assert got == want
    assert source.cache.stats.downloads == 2
    assert np.all(source.has_image())


def _restart(server: S3) -> None:
    from moto.server import ThreadedMotoServer

    server.server = ThreadedMotoServer(ip_address="127.0.0.1", port=server.port, verbose=False)
    server.server.start()  # moto keeps its objects per process: the same data


def test_a_store_that_failed_its_retries_fails_at_once_for_a_while(tmp_path, monkeypatch):
    """A whole-storage outage: after one shard failed past its retries, the other shards not on
    the disk fail at once (a replacement pays nothing), cached ones read on, and once DOWN_S
    has passed the store is tried again."""
    from vltrain.data.sources import shard_cache

    server = S3()
    server.env(monkeypatch)
    source, rows_of = _outage_source(server, tmp_path, "outage-c")
    want = source.read_image(int(rows_of[7]))
    for p in (tmp_path / "cache" / "remote").iterdir():
        if "00007" in p.name:
            p.unlink()
    source.read_image(0)
    server.stop()
    source.cache.retries, source.cache.backoff_s = 1, 0.5
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError, match="00005.tar: not readable after 2 attempts"):
        source.read_image(int(rows_of[5]))
    first = time.monotonic() - t0
    assert first >= 0.5  # the retry's backoff was paid once
    t0 = time.monotonic()
    for k in (6, 7, 8, 9):
        with pytest.raises(RemoteReadError) as e:
            source.read_image(int(rows_of[k]))
        text = str(e.value)
        assert f"s3://outage-c/shards/{k:05d}.tar: not tried" in text and "00005.tar" in text
        assert server.endpoint in text and "2 attempts" in text
    assert time.monotonic() - t0 < 0.25  # no network, no backoff
    assert source.read_image(1)  # what is on the disk reads on
    monkeypatch.setattr(shard_cache, "DOWN_S", 0.0)
    _restart(server)
    try:
        assert source.read_image(int(rows_of[7])) == want  # tried again: read
    finally:
        server.stop()


def _train_through_an_outage(tmp_path_factory, tmp_path, monkeypatch, **extra):
    """A 2-rank run from 4 shards on a moto server, with room for 2.5 of them in the cache; the
    server is stopped at the run's first log line (step 5), so it soon needs a shard that is not
    on the disk. Bounded: refused connections fail in seconds, then at once (DOWN_S)."""
    from kits.runkit import finish, launch, overrides, session_shapes
    from kits.s3kit import upload_shards

    shapes = session_shapes(tmp_path_factory)
    server = S3()
    server.env(monkeypatch)
    server.reset()  # moto keeps its buckets per process: another test's bkt may be there
    pattern, largest = upload_shards(server, shapes, tmp_path)
    run_dir = tmp_path / "run"
    proc = launch(["train", shapes / "base.yaml", *overrides(shapes, run_dir, data__train=pattern,
                                                           data__cache_dir=tmp_path / "cache",
                                                           data__cache_limit_gb=2.5 * largest / 2**30,
                                                           checkpoint__every=0, **extra)], 2)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the run never logged a step"
        time.sleep(0.1)
    server.stop()
    return finish(proc, 120), run_dir, server.endpoint


def _errors(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("vltrain") and ": error: " in x]


def test_a_run_whose_storage_goes_away_replaces_and_counts_the_samples(tmp_path_factory, tmp_path, monkeypatch):
    """on_error: skip with room for them: every sample of a shard that cannot be fetched is
    replaced from the shards on the disk, logged with the URL and endpoint, and the run ends."""
    done, run_dir, endpoint = _train_through_an_outage(tmp_path_factory, tmp_path, monkeypatch,
                                                       train__max_steps=60, data__max_bad_fraction=1.0)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (run_dir / "checkpoints" / "step-60").is_dir()
    bad = [json.loads(x) for x in (run_dir / "bad_samples.jsonl").read_text().splitlines()]
    assert bad, "no sample was replaced: the outage was never met"
    assert all("s3://bkt/shards/" in b["reason"] and endpoint in b["reason"] for b in bad), bad[:3]
    assert any("not readable after 3 attempts" in b["reason"] for b in bad), bad[:3]
    assert f"bad samples: {len(bad)} replaced" in done.stdout, done.stdout[-2000:]  # every one counted


@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_run_whose_storage_goes_away_stops_with_one_message(tmp_path_factory, tmp_path, monkeypatch, on_error):
    """on_error: fail stops at the first shard that cannot be fetched; skip stops once the
    replaced samples are above data.max_bad_fraction (0.01). Either way one message naming the
    URL, the endpoint and the attempts, within the timeouts."""
    done, _, endpoint = _train_through_an_outage(tmp_path_factory, tmp_path, monkeypatch,
                                                 train__max_steps=400, data__on_error=on_error)
    assert done.returncode != 0
    errors = _errors(done.stderr)
    assert errors, done.stderr[-4000:]
    first = errors[0]
    assert "s3://bkt/shards/0000" in first and endpoint in first and "3 attempts" in first, errors
    assert ("bad sample" if on_error == "fail" else "data.max_bad_fraction=0.01") in first, errors


def test_a_run_whose_storage_comes_back_within_the_retries_loses_no_sample(tmp_path_factory, tmp_path, monkeypatch):
    """The server is stopped at the run's first log line and started again (same data) once a read
    has met the outage, within data.remote_retries=6 (about 32 s of waiting): that read succeeds,
    nothing is replaced (data.max_bad_fraction=0 would stop on the first) and the run ends."""
    import subprocess

    from kits.runkit import session_shapes, train_command
    from kits.s3kit import upload_shards

    shapes = session_shapes(tmp_path_factory)
    server = S3()
    server.env(monkeypatch)
    server.reset()
    pattern, largest = upload_shards(server, shapes, tmp_path)
    run_dir, log_file = tmp_path / "run", tmp_path / "stderr.txt"
    launch = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd = train_command(shapes, run_dir, launch, data__train=pattern, data__cache_dir=tmp_path / "cache",
                        data__cache_limit_gb=2.5 * largest / 2**30, checkpoint__every=0, train__max_steps=60,
                        data__remote_retries=6, data__max_bad_fraction=0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VLTRAIN_FAULT", None)
    with open(log_file, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the run never logged a step"
            time.sleep(0.1)
        server.stop()
        while "attempt 1 of 7 failed" not in log_file.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "no read met the outage"
            time.sleep(0.1)
        _restart(server)
        assert proc.wait(timeout=120) == 0, log_file.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        server.stop()
    retried = [x for x in log_file.read_text().splitlines() if "attempt 1 of 7 failed" in x]
    assert "s3://bkt/shards/" in retried[0] and "retrying in 0.5 s" in retried[0], retried
    assert not (run_dir / "bad_samples.jsonl").exists()
    assert (run_dir / "checkpoints" / "step-60").is_dir()
