"""An exponential moving average of the weights (``train.ema``).

fp32 copies of the trainable parameters, made after ``parallelize``: under FSDP2 each copy is a
DTensor with its parameter's placement, so each rank averages its own shard and a checkpoint
writes and reshards them like the parameters. Frozen parameters and buffers do not change, so the
average of the model is theirs plus these.

An update runs after every ``every``-th optimizer step, on the device and without waiting for it:
a step the guard skipped left the weights as they were, and the average takes them as they are,
as timm's ``ModelEmaV3`` does after a skipped step. Its decay depends on the number of updates
alone (a host counter), so two runs, a resumed one, and runs on any number of ranks average the
same weights the same way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from vltrain.config.job import EmaSettings
from vltrain.errors import UserError

WARMUP_POWER = 2 / 3
"""timm's ModelEmaV3 warm-up: decay_t = 1 - (1 + t)^(-2/3), about 0.37 at t = 1, 0.95 at t = 90 and
0.999 at t = 31,622."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view: writing it writes the DTensor), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class WeightAverage:
    """The EMA of ``model``'s trainable parameters. Stateful: ``updates`` and the fp32 averages by
    parameter name (the checkpoint's ``ema.weights.NAME``)."""

    def __init__(self, settings: EmaSettings, model: torch.nn.Module):
        self.settings = settings
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.weights = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.shards = [_local(w) for w in self.weights]
        """This rank's part of each average (a view: loading a checkpoint into the weights fills it)."""
        self.updates = 0

    def decay(self, update: int) -> float:
        """The decay of the ``update``-th update (1-based)."""
        if not self.settings.warmup:
            return self.settings.decay
        return min(self.settings.decay, 1.0 - (1.0 + update) ** -WARMUP_POWER)

    @torch.no_grad()
    def after_step(self, steps: int) -> None:
        """After the ``steps``-th optimizer step of the run (1-based): update if it is due."""
        if steps % self.settings.every:
            return
        self.updates += 1
        weight = 1.0 - self.decay(self.updates)
        torch._foreach_lerp_(self.shards, [_local(p).float() for p in self.params], weight)

    @torch.no_grad()
    def restart(self) -> None:
        """Start again from the weights as they are (a stage turns the EMA teacher on: SigLIP 2's
        teacher is initialized from the student at that point), the warm-up from its first update."""
        for w, p in zip(self.shards, self.params):
            w.copy_(_local(p))
        self.updates = 0

    @torch.no_grad()
    def swap(self, old: torch.Tensor, new: torch.Tensor, resize) -> None:
        """Average ``new`` where ``old`` was (a parameter replaced by another shape of it), the average
        so far carried over by ``resize``."""
        i = next(k for k, p in enumerate(self.params) if p is old)
        self.params[i], self.weights[i] = new, resize(self.weights[i])
        self.shards[i] = _local(self.weights[i])

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model's parameters inside the block; the trained ones again,
        bit for bit, after it."""
        with torch.no_grad():
            kept = [_local(p).clone() for p in self.params]
            for p, w in zip(self.params, self.shards):
                _local(p).copy_(w)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    _local(p).copy_(k)

    # -- Stateful ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "weights": dict(zip(self.names, self.weights))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["weights"]
        if set(saved) != set(self.names):
            missing = sorted(set(self.names) - set(saved))[:3]
            raise UserError(f"the checkpoint's EMA averages other parameters than this run trains (e.g. "
                            f"{missing or sorted(set(saved) - set(self.names))[:3]}): was train.freeze changed?")
        with torch.no_grad():
            for name, w in zip(self.names, self.weights):
                if saved[name] is not w:
                    w.copy_(saved[name])
        self.updates = int(state["updates"])

    @staticmethod
    def missing(path: Any) -> str:
        """The line for a resume with ``train.ema`` on from a checkpoint written without it."""
        return (f"checkpoint {path} holds no EMA weights: its run trained without train.ema. Resume it with "
                "train.ema.decay=0, or start a new run from its weights with the EMA on: "
                f"model.init={path} run.dir=NEW_FOLDER")
