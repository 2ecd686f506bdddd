"""A real S3-compatible server on 127.0.0.1 for remote-storage tests: moto in server mode.

``s3_server`` starts one server per test module; ``s3`` points the AWS variables at it for one
test and empties it first. Objects are written with s3fs, as a user's upload tool would.
"""

from __future__ import annotations

import io
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest
from kits.multiproc import free_port

from vltrain.data.sources.manifests import open_manifest
from vltrain.data.sources.shards import write_shards


class S3:
    """One moto server; ``put``/``delete`` write to it directly, bypassing vltrain."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self._fs = None

    @property
    def fs(self):
        import s3fs

        if self._fs is None:
            self._fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, key="testing", secret="testing",
                                         skip_instance_cache=True, use_listings_cache=False)
        return self._fs

    def env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", self.endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
            monkeypatch.delenv(var, raising=False)

    def reset(self) -> None:
        """Every bucket and object gone (moto's own reset call)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        # the first request imports moto's backends: seconds on a busy machine
        urllib.request.urlopen(req, timeout=120).close()

    def bucket(self, name: str) -> None:
        self.fs.mkdir(name)

    def put(self, url: str, data: bytes) -> None:
        self.fs.pipe_file(url, data)

    def delete(self, url: str) -> None:
        self.fs.rm_file(url)

    def stop(self) -> None:
        self.server.stop()


def tar_shard(n: int, seed: int = 0, image_bytes: int = 2000) -> bytes:
    """An img2dataset-style tar: ``KEY.jpg`` (filler bytes), ``KEY.txt``, ``KEY.json`` per sample."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(n):
            key = f"{seed:05d}{i:04d}"
            members = {"jpg": bytes([(seed * 31 + i) % 256]) * image_bytes,
                       "txt": f"caption {seed} {i}".encode(), "json": f'{{"id": "{key}"}}'.encode()}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    s3_server.reset()
    s3_server.env(monkeypatch)
    return s3_server


def evict_after_lookup(cache, other, url: str, push: str) -> None:
    """``url`` fetched into the cache by ``other``; the first time ``cache`` then finds it there,
    ``other`` fetches ``push``, which evicts it, before ``cache`` can go on."""
    other.local(url)
    path, fresh, cache.raced = cache.path_for(url), cache._fresh, []

    def fresh_then_evicted(p, want) -> bool:
        found = fresh(p, want)
        if found and p == path and not cache.raced:
            cache.raced.append(p)
            time.sleep(0.02)  # a younger file than it: evicted first
            other.local(push)
            assert not p.exists()
        return found

    cache._fresh = fresh_then_evicted


def upload_shards(s3, shapes: Path, tmp: Path) -> tuple[str, int]:
    """The shapes rows as 4 tar shards in s3://bkt/shards/; the pattern and the largest shard's size."""
    written, _ = write_shards(open_manifest(shapes / "train.jsonl"), tmp / "local-shards", 20)
    s3.bucket("bkt")
    for path in written:
        s3.put(f"s3://bkt/shards/{path.name}", path.read_bytes())
    return f"s3://bkt/shards/{{00000..{len(written) - 1:05d}}}.tar", max(p.stat().st_size for p in written)
