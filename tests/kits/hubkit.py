"""A Hugging Face Hub cache filled beforehand, in the layout ``huggingface_hub`` writes, so that
``hf-hub:`` names resolve with nothing downloaded::

    HUB/models--ORG--NAME/blobs/<sha256 of the file>
    HUB/models--ORG--NAME/snapshots/<commit>/<file> -> ../../blobs/<sha256>
    HUB/models--ORG--NAME/refs/<branch or tag>        (the commit, no newline)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def commit_of(text: str) -> str:
    """A 40-hex commit sha, made up from ``text``."""
    return hashlib.sha1(text.encode()).hexdigest()


def put(hub: Path, repo: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Every file of ``folder`` cached as ``repo`` at ``commit``, with ``refs`` naming it; returns the
    snapshot folder."""
    storage = hub / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)  # fetched again: the same file
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty cache that ``hf-hub:`` names resolve in, offline (``HF_HUB_OFFLINE=1``: nothing may be
    downloaded)."""
    pytest.importorskip("huggingface_hub")
    hub = tmp_path / "hf-home" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hub.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub
