"""How a checkpoint is stored: state trees as JSON plus tensors, read safely, written atomically.

Everything that is not a tensor goes to JSON instead of DCP's pickled byte entries, and DCP's
pickled index is read with an allow-list of its own metadata classes: loading a checkpoint never
runs code from it. Files and folders reach their final names by an atomic rename, so a crash at
any moment leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from vltrain.errors import UserError

# DCP warns on every call made without a process group; one process is a supported case here
warnings.filterwarnings("ignore", message="torch.distributed is .*single process", category=UserWarning)

# ---------------------------------------------------------------------------------------------
# State trees <-> (JSON skeleton, flat tensors)

_MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__")


def split_tensors(obj: Any, key: str, tensors: dict[str, torch.Tensor] | None) -> Any:
    """A JSON-able copy of ``obj`` with each tensor moved to ``tensors[path]`` and a placeholder left.

    ``tensors=None`` means tensors are not allowed here (per-rank JSON states). Tuples, dicts with
    non-string keys and numpy values are tagged so :func:`join_tensors` returns the same types.
    """
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            raise TypeError(f"per-rank state {key!r} holds a tensor; per-rank states must be plain data")
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: split_tensors(v, f"{key}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[split_tensors(k, f"{key}.{k}", None), split_tensors(v, f"{key}.{k}", tensors)]
                              for k, v in obj.items()]}
    if isinstance(obj, tuple):  # also torch.Size
        return {"__tuple__": [split_tensors(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_tensors(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"state {key!r} holds a {type(obj).__name__}, which a checkpoint cannot store")


def join_tensors(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`."""
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            return tensors[skel["__tensor__"]]
        if "__tuple__" in skel:
            return tuple(join_tensors(v, tensors) for v in skel["__tuple__"])
        if "__items__" in skel:
            return {join_tensors(k, tensors): join_tensors(v, tensors) for k, v in skel["__items__"]}
        if "__ndarray__" in skel:
            return np.asarray(skel["__ndarray__"], dtype=skel["dtype"])
        return {k: join_tensors(v, tensors) for k, v in skel.items()}
    if isinstance(skel, list):
        return [join_tensors(v, tensors) for v in skel]
    return skel


def tensor_keys(skel: Any) -> list[str]:
    """The keys of the tensors a skeleton from :func:`split_tensors` holds placeholders for."""
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            return [skel["__tensor__"]]
        return [k for v in skel.values() for k in tensor_keys(v)]
    if isinstance(skel, list):
        return [k for v in skel for k in tensor_keys(v)]
    return []

# ---------------------------------------------------------------------------------------------
# Reading DCP without running code from the checkpoint


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index, allowing only the plain classes it is made of."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata":
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(dcp.FileSystemReader):
    """A DCP reader whose index is unpickled through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError) as e:
            raise UserError(f"{path} is not a checkpoint index this version can read safely: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """We never write pickled byte entries, so reading one means the checkpoint is not ours."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UserError(f"checkpoint entry {read_item.dest_index.fqn!r} is pickled data; refusing to load it")


def load_tensors(reader: SafeFileSystemReader, targets: dict[str, torch.Tensor], *, no_dist: bool,
                 process_group: Any = None) -> None:
    """Load ``targets`` in place, refusing pickled entries."""
    dcp.load(targets, storage_reader=reader, planner=_TensorsOnlyLoadPlanner(),
             process_group=process_group, no_dist=no_dist)


def read_tensors(ckpt: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every saved tensor whose key starts with ``prefix``, full and on CPU, in one process.

    For inspection and for comparing runs (``model.`` for the weights, ``optimizer.`` for Adam's
    moments), without building the model.
    """
    reader = SafeFileSystemReader(ckpt)
    index = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in index.items()
           if k.startswith(prefix) and hasattr(m, "size")}
    load_tensors(reader, out, no_dist=True)
    return out


# ---------------------------------------------------------------------------------------------
# Atomic writes

PART_SUFFIX = ".part"
"""What :func:`write_atomic` names a file while it is being written."""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + PART_SUFFIX)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_weights(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Full tensors by name to a safetensors file (tensors only: reading it runs no code), atomically."""
    from safetensors.torch import save_file

    # clone: tied weights share storage, which safetensors refuses; each key gets its own copy
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    tmp = path.with_name(path.name + PART_SUFFIX)
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; weights are meant to be shared
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    rename_durably(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def rename_durably(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` and make the rename reach the disk."""
    os.rename(src, dst)
    _fsync_dir(dst.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX): the directory entry itself must reach the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
