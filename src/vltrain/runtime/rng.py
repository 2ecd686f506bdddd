"""Capture and restore every random number generator a rank uses, as plain JSON.

Exact resume needs the same dropout masks, augmentations and worker seeds after a restart as in a
run never stopped, so each rank saves torch (CPU and every CUDA device), numpy and Python states
at the checkpoint and puts them back last, after everything that consumes randomness while being
built. The state is JSON (integers and base64), never pickle, so reading a checkpoint cannot run
code.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def _encode_bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _decode_bytes(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's generator states (torch, CUDA if initialized, numpy legacy global, random)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": _encode_bytes(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what :func:`capture` returned."""
    torch.set_rng_state(_decode_bytes(state["torch"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_decode_bytes(s) for s in cuda])


def seeded(seed: int) -> "RngState":
    """Seed torch, numpy and random (a rank's generators, ``seed``); the generators a checkpoint keeps."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    return RngState()


class RngState:
    """The generators as a Stateful, for the checkpointer's per-rank states."""

    def state_dict(self) -> dict[str, Any]:
        return capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore(state)
