"""The batch every loader yields (:class:`Batch`), and its move to the device as the model's
:class:`~vltrain.types.ModelInputs`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from vltrain.data.config import ModalityWeights
from vltrain.data.teacher_store import TeacherInputs
from vltrain.images import Images
from vltrain.types import ModelInputs, TeacherEmbeds, TeacherView


@dataclass
class Batch:
    """One micro-batch. Images stay uint8 until :meth:`pixels`, which runs where the batch lands.

    Rows without an image hold zeros in ``pixel_values``; rows without text hold only padding.
    ``errors`` lists ``(key, reason)`` for samples that were replaced because they could not be
    read; the main process writes them to ``bad_samples.jsonl`` and counts them.
    """

    ids: torch.Tensor  # int64 [B], stable_uid of each sample's key
    images: Images  # uint8 pixels [B, 3, H, W]; at their own shape [B, N, 3 * p * p] patches, padded or packed
    has_image: torch.Tensor  # bool [B]
    has_text: torch.Tensor  # bool [B]
    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L]
    source: torch.Tensor | None = None  # int64 [B], index of the source in a mixture
    teacher_images: Images | None = None  # a teacher that runs: its view, uint8 [B, 3, T, T] or at its own shape
    teacher_input_ids: torch.Tensor | None = None  # int64 [B, Lt], the captions in the teacher's tokenizer
    teacher_attention_mask: torch.Tensor | None = None  # int64 [B, Lt]
    teacher_image_embeds: torch.Tensor | None = None  # float32 [B, Dt], stored teacher embeddings
    teacher_text_embeds: torch.Tensor | None = None  # float32 [B, Dt]
    region_ids: torch.Tensor | None = None
    """int64 [B, R, Lr]: each image's region phrases (``images.boxes``' R) tokenized as captions are,
    padded with the tokenizer's pad id; None when ``images.boxes`` is."""
    region_attention_mask: torch.Tensor | None = None  # int64 [B, R, Lr]: 1 on each phrase's tokens
    num_truncated: int = 0
    num_regions_cut: int = 0
    """Regions dropped because the crop left less than half of them (``vltrain.data.regions``)."""
    num_regions_capped: int = 0
    """Regions dropped past ``data.max_regions``."""
    counts: tuple[int, int] | None = None
    """Rows with an image, rows with text: counted by the collator, so the step need not ask the device."""
    errors: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the batch by name, its images' as ``images.pixels``, ``images.grids``, ..."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v
            elif isinstance(v, Images):
                out |= {f"{f.name}.{k}": t for k, t in v.tensors().items()}
        return out

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], **rest) -> "Batch":
        """A batch from tensors named as :meth:`tensors` names them (``images.pixels``: a field of its
        images), and its other fields."""
        return _rebuild(tensors, rest)

    def __reduce__(self):
        """Tensors that are views of one buffer (a loader worker's, ``collate.batch_buffers``) are
        sent as that buffer, once, and viewed again on arrival; any others as usual."""
        tensors = self.tensors()
        storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        rest = {f.name: getattr(self, f.name) for f in fields(self)
                if not isinstance(getattr(self, f.name), (torch.Tensor, Images))}
        if len(storages) != 1 or not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values()):
            return (_rebuild, (tensors, rest))
        storage = next(iter(tensors.values())).untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        layout = {k: (t.dtype, t.storage_offset(), tuple(t.shape)) for k, t in tensors.items()}
        return (_rebuild_flat, (flat, layout, rest))

    def _map(self, fn) -> "Batch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = fn(v) if isinstance(v, torch.Tensor) else v.map(fn) if isinstance(v, Images) else v
        return Batch(**kw)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """Called by DataLoader(pin_memory=True) in its pinning thread."""
        return self._map(lambda t: t.pin_memory())

    def pixels(self, mean: list[float], std: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Normalized float images, computed once per batch on the batch's device."""
        return normalize_pixels(self.images.pixels, mean, std, dtype)

    def to_model_inputs(
        self,
        device: torch.device | str,
        mean: list[float],
        std: list[float],
        modality_weights: ModalityWeights | None = None,
        source_loss_weights: list[float] | None = None,
        teacher: TeacherInputs | None = None,
        pixel_dtype: torch.dtype = torch.float32,
    ) -> "ModelInputs":
        """The batch on ``device`` with normalized pixels. Per-row weights, unless all are 1: the
        modality's weight (``data.modality_weights``) times the source's ``loss_weight``. With a
        distillation ``teacher``: its view of the rows (normalized with its statistics), or its
        stored embeddings. ``pixel_dtype``: fp32, or fp64 for an fp64 run."""
        batch = self.to(device, non_blocking=True)  # pinned by the loader on CUDA
        row_weights = None
        w = modality_weights or ModalityWeights()
        if (w.image_text, w.text_only, w.image_only) != (1.0, 1.0, 1.0):
            both_w, text_w, image_w = w.image_text, w.text_only, w.image_only
            both = batch.has_image & batch.has_text
            row_weights = torch.where(both, both_w, torch.where(batch.has_text, text_w, image_w)).to(torch.float32)
        if source_loss_weights is not None and any(x != 1.0 for x in source_loss_weights):
            per_source = torch.tensor(source_loss_weights, dtype=torch.float32, device=batch.ids.device)[batch.source]
            row_weights = per_source if row_weights is None else row_weights * per_source
        return ModelInputs(
            images=replace(batch.images, pixels=batch.pixels(mean, std, pixel_dtype)), input_ids=batch.input_ids,
            attention_mask=batch.attention_mask, has_image=batch.has_image, has_text=batch.has_text, ids=batch.ids,
            row_weights=row_weights, source=batch.source, counts=self.counts, region_ids=batch.region_ids,
            region_attention_mask=batch.region_attention_mask, **batch._teacher_inputs(teacher),
        )

    def _teacher_inputs(self, teacher: TeacherInputs | None) -> dict:
        """``ModelInputs``' teacher_view or teacher (stored embeddings), for ``to_model_inputs``."""
        if teacher is None:
            return {}
        if self.teacher_image_embeds is not None:
            scale, bias = teacher.constants(self.teacher_image_embeds.device)
            return {"teacher": TeacherEmbeds(self.teacher_image_embeds, self.teacher_text_embeds, scale, bias)}
        d = teacher.data
        images = self.teacher_images
        return {"teacher_view": TeacherView(replace(images, pixels=normalize_pixels(images.pixels, d.mean, d.std)),
                                            self.teacher_input_ids, self.teacher_attention_mask)}


def _rebuild(tensors: dict, rest: dict) -> Batch:
    """A batch from :meth:`Batch.tensors` (``images.pixels``: a field of its images) and the rest."""
    kw, images = dict(rest), {}
    for name, t in tensors.items():
        owner, _, field_name = name.rpartition(".")
        if owner:
            images.setdefault(owner, {})[field_name] = t
        else:
            kw[name] = t
    return Batch(**kw, **{owner: Images(**parts) for owner, parts in images.items()})


def _rebuild_flat(flat: torch.Tensor, layout: dict, rest: dict) -> Batch:
    storage = flat.untyped_storage()
    tensors = {k: torch.empty(0, dtype=dtype).set_(storage, offset, shape) for k, (dtype, offset, shape) in layout.items()}
    return _rebuild(tensors, rest)


def normalize_pixels(
    pixel_values: torch.Tensor, mean: list[float], std: list[float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [B,3,H,W] -> (x/255 - mean) / std, as one fused scale-and-shift. Patches [B, N, 3 * p * p]
    (channel, y, x within a patch) take each channel's statistics over its p * p values. Computed in
    fp32, or in fp64 for an fp64 ``dtype``: CPU kinds round fp32's fused multiply-add differently
    (FMA or not), and an fp64 run must not inherit that."""
    dev = pixel_values.device
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    m = torch.tensor(mean, dtype=wide, device=dev)
    s = torch.tensor(std, dtype=wide, device=dev)
    if pixel_values.dim() == 3:
        per_channel = pixel_values.shape[-1] // 3
        m, s = m.repeat_interleave(per_channel), s.repeat_interleave(per_channel)
    else:
        m, s = m.view(-1, 1, 1), s.view(-1, 1, 1)
    scale = 1.0 / (255.0 * s)
    shift = -m / s
    return torch.addcmul(shift, pixel_values.to(wide), scale).to(dtype)
