"""Models by their Hub name: ``hf-hub:ORG/NAME[@REVISION]``, resolved to a folder of the Hugging Face
cache, so that :func:`vltrain.checkpoint.paths.locate` opens it as it opens a folder on disk.

The name is OpenCLIP's spelling (``hf-hub:``); ``REVISION`` is a branch, a tag or a commit sha (the
repository's default branch without one). ``huggingface_hub`` does the fetching and keeps the cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``; ``HF_HUB_OFFLINE=1``: the cache alone). It is imported here
only, and only when a name is given: vltrain needs it for nothing else.

Both the cache folder and the offline switch are read from the environment at each call, not from
``huggingface_hub.constants``, which reads them once, when it is first imported (transformers imports
it early): the environment a command runs in is the one that counts.

What is fetched is what vltrain reads, not the whole repository (which often holds the same weights
as PyTorch, TensorFlow and Flax files): first the configs and tokenizer files (``*.json``, ``*.txt``),
which say whether it is a transformers model (``config.json`` with a ``model_type``) or an OpenCLIP
one (``open_clip_config.json``), then one weights file of that kind, in the order the readers look
for them (:data:`~vltrain.model.interop.pretrained.HF_WEIGHTS`,
:data:`~vltrain.model.interop.openclip_coca.WEIGHT_FILES`). A snapshot that already holds them is
not fetched again.

The commit a name resolved to is kept: :attr:`Snapshot.pinned` (``hf-hub:ORG/NAME@SHA``) is what the
decided config saves (:func:`vltrain.compose.decide.decide`), so that a resumed run, or a later
``vltrain eval RUN``, reads that commit and no newer one.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vltrain.errors import UsageError, UserError
from vltrain.model.interop.hf_clip import read_json
from vltrain.model.interop.openclip_coca import CONFIG_FILE as OPENCLIP_CONFIG, WEIGHT_FILES as OPENCLIP_WEIGHTS
from vltrain.model.interop.pretrained import HF_WEIGHTS, imported_kind

log = logging.getLogger(__name__)

PREFIX = "hf-hub:"
CONFIG_PATTERNS = ["*.json", "*.txt"]
"""The configs, the tokenizer and the image processor's settings: small, and read before the weights."""
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_NAME = re.compile(rf"^({_PART})/({_PART})(?:@([A-Za-z0-9_.][A-Za-z0-9_./-]*))?$")
"""ORG/NAME as the Hub allows them (letters, digits, ``-``, ``_``, ``.``; at most 96 each, no ``--``
or ``..``), then an optional revision."""
_SHA = re.compile(r"^[0-9a-f]{40}$")
SYNTAX = ("hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION (a branch, tag or commit sha), e.g. "
          "hf-hub:openai/clip-vit-base-patch32")


@dataclass(frozen=True)
class HubName:
    """A repository of the Hub and the revision asked for ("": its default branch)."""

    repo: str
    revision: str = ""

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}" + (f"@{self.revision}" if self.revision else "")

    @property
    def is_commit(self) -> bool:
        return bool(_SHA.match(self.revision))


@dataclass(frozen=True)
class Snapshot:
    """A Hub name resolved: the cached folder of one commit."""

    name: HubName
    folder: Path
    commit: str

    @property
    def pinned(self) -> str:
        """The name pinned to its commit: ``hf-hub:ORG/NAME@SHA``."""
        return str(HubName(self.name.repo, self.commit))


def is_hub_name(value: object) -> bool:
    return isinstance(value, (str, Path)) and str(value).startswith(PREFIX)


def parse(value: str, role: str = "") -> HubName:
    """``hf-hub:ORG/NAME[@REVISION]`` read (``role`` heads the message when it is malformed)."""
    text = str(value)
    m = _NAME.match(text.removeprefix(PREFIX))
    bad = m is None or any(s in text for s in ("--", "..")) or m.group(2).endswith(".git")
    if bad:
        raise UsageError(f"{role + ' ' if role else ''}{text!r} is not a Hub model name: write {SYNTAX} (ORG and "
                         "NAME: letters, digits, '-', '_', '.'; the revision after one '@', not empty)")
    return HubName(f"{m.group(1)}/{m.group(2)}", m.group(3) or "")


def cache_folder() -> Path:
    """The Hub cache ``huggingface_hub`` reads and writes: ``HF_HUB_CACHE``, else ``HF_HOME/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    found = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(found)).expanduser()


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set true: the cache alone, nothing fetched."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve(value: str, role: str = "") -> Snapshot:
    """The cached folder of ``value`` (a Hub name), fetched unless the cache holds it or the Hub is off;
    the resolution said in one line."""
    name = parse(value, role)
    hub = _import(name, role)
    cache, local = cache_folder(), offline()
    folder = _snapshot(hub, name, CONFIG_PATTERNS, cache, local, role)
    snapshot = Snapshot(name, folder, folder.name)
    wanted = _weights_wanted(snapshot, role)
    if wanted:
        if local:
            raise UserError(f"{role + ' ' if role else ''}{name}: the cached snapshot {folder} holds no weights "
                            f"({', '.join(wanted)}), and HF_HUB_OFFLINE is set: fetch them once online "
                            "(HF_HUB_OFFLINE=0), or copy the model into that cache")
        folder = _snapshot(hub, HubName(name.repo, snapshot.commit), _pick(hub, snapshot, wanted), cache, local, role)
    log.info(f"{role + ' ' if role else ''}{name}: commit {snapshot.commit} ({folder})")
    return snapshot


def _import(name: HubName, role: str):
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(f"{role + ' ' if role else ''}{name} names a model on the Hugging Face Hub, which needs the "
                        "huggingface_hub package: pip install 'vltrain[hub]'") from None
    return huggingface_hub


def _snapshot(hub, name: HubName, patterns: list[str], cache: Path, local: bool, role: str) -> Path:
    """The snapshot folder of ``name`` holding the files ``patterns`` match (fetched when not ``local``)."""
    from huggingface_hub.utils import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    head = f"{role + ' ' if role else ''}{name}"
    try:
        return Path(hub.snapshot_download(name.repo, revision=name.revision or None, cache_dir=str(cache),
                                          local_files_only=local, allow_patterns=patterns))
    except RevisionNotFoundError:
        raise UsageError(f"{head}: the repository has no revision {name.revision!r}: give a branch, tag or "
                         "commit sha it has") from None
    except RepositoryNotFoundError:
        raise UsageError(f"{head}: no such repository on the Hub, or it is private or gated: check the name, or "
                         "log in (hf auth login) with access to it") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if local else "the Hub could not be reached"
        raise UserError(f"{head} is not in the cache {cache} (searched {cache / _folder_name(name.repo)} for "
                        f"revision {name.revision or 'main'}), and {why}: "
                        "fetch it once online (HF_HUB_OFFLINE=0), or point HF_HUB_CACHE / HF_HOME at the cache "
                        "that holds it") from None


def _folder_name(repo: str) -> str:
    """The cache's folder of a model repository: ``models--ORG--NAME``."""
    return "models--" + repo.replace("/", "--")


def _weights_wanted(snapshot: Snapshot, role: str) -> list[str]:
    """The weights files a snapshot's configs call for, none of which it holds yet ([]: it holds one).
    A snapshot whose configs are neither a transformers model's nor OpenCLIP's is refused, naming what
    it holds."""
    folder = snapshot.folder
    if (folder / "config.json").is_file() and "model_type" in read_json(folder / "config.json"):
        imported_kind(folder)  # a model_type vltrain does not open is said now, before any weights are fetched
        names = list(HF_WEIGHTS)
    elif (folder / OPENCLIP_CONFIG).is_file():
        names = list(OPENCLIP_WEIGHTS)
    else:
        held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise UsageError(f"{role + ' ' if role else ''}{snapshot.name} (commit {snapshot.commit}) holds neither a "
                         "transformers model (config.json with a model_type) nor an OpenCLIP model "
                         f"({OPENCLIP_CONFIG}): it holds {', '.join(held) or 'nothing'}; name a repository of a "
                         "CLIPModel, SiglipModel, Siglip2Model, BLIP or OpenCLIP model")
    return [] if any((folder / n).is_file() for n in names) else names


def _pick(hub, snapshot: Snapshot, wanted: list[str]) -> list[str]:
    """The first of ``wanted`` the repository has at the commit (with a shard index, its shards)."""
    try:
        files = set(hub.list_repo_files(snapshot.name.repo, revision=snapshot.commit))
    except Exception as e:  # the client's network errors differ by its version: each is said, in one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"{snapshot.name} (commit {snapshot.commit}): the cached snapshot {snapshot.folder} holds no "
                        f"weights yet, and the Hub could not list them ({type(e).__name__}: {first}): retry online, "
                        "or set HF_HUB_OFFLINE=1 to use only what the cache holds") from None
    first = next((n for n in wanted if n in files), None)
    if first is None:
        raise UsageError(f"{snapshot.name} (commit {snapshot.commit}) holds none of the weights files vltrain reads "
                         f"({', '.join(wanted)})")
    if first.endswith(".index.json"):
        shards = read_json(snapshot.folder / first).get("weight_map", {}).values()
        return [first, *sorted(set(shards))]
    return [first]
