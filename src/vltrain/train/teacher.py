"""The teacher of distillation (``model.teacher``): opened through the one door
(:func:`vltrain.compose.opening.open_model`), frozen, and run without autograd under the run's
precision on its own view of each batch; or, with ``model.teacher.precomputed``, not run at all: the
loader reads the embeddings ``vltrain data teacher-embed`` stored (:mod:`vltrain.data.teacher_store`).

What a teacher is, for stored embeddings, is :func:`teacher_identity`: its kind, its path, its weights'
size and its config's hash. A teacher that changed (a run that trained on, a re-export) is another one.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from vltrain.checkpoint.paths import EXPORT, HF, HF_CONFIG, OPENCLIP, Located
from vltrain.compose.decide import TeacherPlan
from vltrain.compose.opening import open_model
from vltrain.config.job import JobConfig
from vltrain.data.image_input import image_layout
from vltrain.data.config import teacher_data
from vltrain.data.teacher_store import TeacherInputs, open_store
from vltrain.errors import ConfigError
from vltrain.objectives.losses import scale_of
from vltrain.types import Encoded, ModelInputs, TeacherEmbeds

log = logging.getLogger(__name__)


def teacher_identity(found: Located) -> dict:
    """What the stored embeddings of a teacher are keyed by: its kind, resolved path and weights, their
    size in bytes, and a hash of the config that rebuilds it."""
    weights = found.weights.resolve()
    files = [weights] if weights.is_file() else sorted(p for p in weights.rglob("*") if p.is_file())
    config = found.config_file() if found.family != OPENCLIP else None
    if found.family == HF:
        config = found.path / HF_CONFIG
    digest = hashlib.blake2b(config.read_bytes(), digest_size=8).hexdigest() if config else ""
    return {"kind": found.family, "path": str(found.path.resolve()), "weights": str(weights),
            "bytes": sum(p.stat().st_size for p in files), "config": digest}


class Teacher:
    """A frozen model that embeds each micro-batch's teacher view (:class:`vltrain.types.TeacherView`)."""

    def __init__(self, plan: TeacherPlan, device: torch.device, autocast, mesh=None):
        """``mesh``: the student's FSDP2 device mesh, to shard the teacher over (None: replicated)."""
        opened = open_model(plan.decided, device=device)
        self.model = opened.model.requires_grad_(False).eval()
        self.tokenizer = opened.tokenizer
        self.data = plan.cfg.data
        self.autocast = autocast
        self.scale = scale_of(self.model.logit_scale.detach()).float()
        bias = self.model.logit_bias
        self.bias = None if bias is None else bias.detach().float()
        self.encoder = _Encoder(self.model)
        if mesh is not None:
            _shard(self.encoder, mesh)

    def inputs(self, student: JobConfig) -> TeacherInputs:
        """What the loader makes for this teacher: its view of every row."""
        return TeacherInputs(data=teacher_data(student.data, self.data), tokenizer=self.tokenizer)

    @torch.no_grad()
    def encode(self, inputs: ModelInputs) -> Encoded:
        """The teacher's encoding of ``inputs`` as it takes them, without autograd, under the autocast."""
        with self.autocast():
            return self.encoder(inputs)

    def embed(self, inputs: ModelInputs) -> TeacherEmbeds:
        view = inputs.teacher_view
        if view is None:
            raise ValueError("a teacher that runs needs the micro-batch's teacher_view (the loader makes it)")
        taken = ModelInputs(images=view.images, input_ids=view.input_ids, attention_mask=view.attention_mask,
                            has_image=inputs.has_image, has_text=inputs.has_text, ids=inputs.ids,
                            counts=inputs.counts)
        enc = self.encode(taken)
        return TeacherEmbeds(enc.image_embeds.float(), enc.text_embeds.float(), self.scale, self.bias)


class _Encoder(torch.nn.Module):
    """The teacher's ``encode`` as a module's forward: what FSDP2 gathers the root's parameters in."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: ModelInputs):
        return self.model.encode(inputs)


def _shard(encoder: _Encoder, mesh) -> None:
    """FSDP2 over the teacher's blocks and the rest, as the student's (its 0-dim scalars replicated)."""
    from torch.distributed.fsdp import fully_shard

    scalars = {p for p in encoder.parameters() if p.ndim == 0}
    for block in encoder.model.blocks_for_sharding():
        fully_shard(block, mesh=mesh)
    fully_shard(encoder, mesh=mesh, ignored_params=scalars)


def stored_inputs(plan: TeacherPlan, sources: list) -> TeacherInputs:
    """The stored embeddings of ``plan``'s teacher for each indexed source (``IndexedSource``), checked:
    complete, of this source's index, of one width and temperature across sources."""
    identity = teacher_identity(plan.located)
    stores = [open_store(s.index_dir, identity, s.name, len(s)) for s in sources]
    first = stores[0].meta
    for s, store in zip(sources[1:], stores[1:]):
        if (store.meta.width, store.meta.scale, store.meta.bias) != (first.width, first.scale, first.bias):
            raise ConfigError(f"{s.name}: its stored teacher embeddings (width {store.meta.width}) differ from "
                              f"{sources[0].name}'s (width {first.width}) though made by the same teacher")
    return TeacherInputs(stores=stores)


def describe(plan: TeacherPlan, cfg: JobConfig) -> str:
    """One line on the teacher when a run starts."""
    d, loss = plan.cfg.data, cfg.model.loss
    weights = ", ".join(f"{k} {getattr(loss, k):g}" for k in ("distill", "distill_sigmoid") if getattr(loss, k))
    how = "its embeddings stored beside the sample indexes" if plan.precomputed else (
        f"run live on {image_layout(d).describe()}, mean {d.mean}, std {d.std}, and its tokenizer {d.tokenizer or '(saved with it)'}")
    kind = "an export" if plan.located.kind == EXPORT else plan.located.kind
    return f"teacher {plan.located.path} ({kind}): {how}; {weights}"
