"""Samples -> :class:`Batch`: images stacked as uint8, texts padded to the batch's longest row."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import get_worker_info

from vltrain.data.batch import Batch
from vltrain.data.config import PAD_MULTIPLE, DataConfig, padded_width
from vltrain.data.dataset import Sample
from vltrain.data.loading.packing import class_slots, layout
from vltrain.data.teacher_store import TeacherInputs
from vltrain.images import Images


def batch_buffers(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Uninitialized tensors of these shapes; in a loader worker, views of one shared-memory buffer.

    A worker's batch reaches the trainer through shared memory. Allocated anywhere else, each
    tensor would be copied there once more when sent, and each would cross as its own file
    descriptor, with a handshake per tensor (about 0.4 ms each, most of a ready batch's
    ``next()``). One buffer is written in place and crosses once (``Batch.__reduce__``).
    """
    if get_worker_info() is None:
        return {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    # widest dtypes first, so that every view starts aligned to its element size
    order = sorted(shapes, key=lambda k: -shapes[k][1].itemsize)
    sizes = [math.prod(shapes[k][0]) * shapes[k][1].itemsize for k in order]
    storage = torch.UntypedStorage._new_shared(max(1, sum(sizes)))
    out, offset = {}, 0
    for k, size in zip(order, sizes):
        shape, dtype = shapes[k]
        out[k] = torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape)
        offset += size
    return out


class Collator:
    """Pads text to the longest row rounded up to ``pad_multiple``, capped at ``max_text_length``.

    Padding to the longest row instead of ``max_text_length`` is most of the text-side saving:
    captions are short, so a fixed pad to 77 or 512 computes mostly padding. The budget packer
    must round the same way: the training loader gives both ``DataConfig.resolve().pad_multiple``.
    """

    def __init__(self, pad_id: int, max_text_length: int, image_size: int, pad_multiple: int = PAD_MULTIPLE,
                 patches: tuple[int, int] | None = None, pack: bool = False, teacher: TeacherInputs | None = None):
        """``patches``: (data.max_patches, patch side) when images come at their own shape: each
        image's patches are then padded with zeros to max_patches, beside its grid, or with ``pack``
        placed into as few sequences of max_patches as hold them (:mod:`.packing`). ``teacher``: the
        samples carry a distillation teacher's part too (:class:`TeacherInputs`)."""
        self.pad_id = pad_id
        self.max_text_length = max_text_length
        self.image_size = image_size
        self.pad_multiple = pad_multiple
        self.patches = patches
        self.pack = pack and patches is not None
        self.teacher = teacher

    @classmethod
    def for_data(cls, pad_id: int, cfg: DataConfig, pad_multiple: int = PAD_MULTIPLE,
                 teacher: TeacherInputs | None = None) -> "Collator":
        """The collator of ``cfg``'s images and captions."""
        patches = (cfg.max_patches, cfg.patch_size) if cfg.resize == "native" else None
        return cls(pad_id, cfg.max_text_length, cfg.image_size, pad_multiple, patches, cfg.pack_images, teacher)

    def _teacher_shapes(self, samples: list[Sample]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        t, n = self.teacher, len(samples)
        if t is None:
            return {}
        if t.stores is not None:
            return {"teacher_image_embeds": ((n, t.width), torch.float32),
                    "teacher_text_embeds": ((n, t.width), torch.float32)}
        longest = max(len(s.teacher_ids) for s in samples)
        length = min(padded_width(max(longest, 1), self.pad_multiple), t.data.max_text_length)
        text = {"teacher_input_ids": ((n, length), torch.int64), "teacher_attention_mask": ((n, length), torch.int64)}
        if t.data.resize == "native":  # one image per row, its patches then zeros to the teacher's budget
            p = t.data.native_patch()
            return {"teacher_pixel_values": ((n, t.data.max_patches, 3 * p * p), torch.uint8),
                    "teacher_grids": ((n, 2), torch.int64), **text}
        size = t.data.image_size
        return {"teacher_pixel_values": ((n, 3, size, size), torch.uint8), **text}

    def _put_teacher(self, t: dict[str, torch.Tensor], samples: list[Sample]) -> None:
        """The teacher's part of each row: zeros (and padding) where the row lacks a side."""
        if self.teacher is None:
            return
        if self.teacher.stores is not None:
            # the stored rows are read-only memory maps: copied through numpy, which torch would warn about
            images, texts = t["teacher_image_embeds"].numpy(), t["teacher_text_embeds"].numpy()
            for i, s in enumerate(samples):
                image, text = s.teacher_embeds
                images[i] = 0 if image is None else image
                texts[i] = 0 if text is None else text
            return
        ids, mask = t["teacher_input_ids"], t["teacher_attention_mask"]
        ids.fill_(self.teacher.tokenizer.pad_id)
        mask.zero_()
        width, pixels, grids = ids.shape[1], t["teacher_pixel_values"], t.get("teacher_grids")
        for i, s in enumerate(samples):
            if grids is None:
                pixels[i] = 0 if s.teacher_image is None else s.teacher_image
            else:
                n = 0 if s.teacher_image is None else s.teacher_image.shape[0]
                pixels[i, :n] = s.teacher_image if n else 0
                pixels[i, n:] = 0
                grids[i] = torch.tensor(s.teacher_grid if n else (1, 1))
            row = s.teacher_ids[:width]
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
            mask[i, :len(row)] = 1

    def _image_shapes(self, n: int, sequences: int, slots: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.patches is None:
            return {"pixel_values": ((n, 3, self.image_size, self.image_size), torch.uint8)}
        most, p = self.patches
        shapes = {"pixel_values": ((sequences, most, 3 * p * p), torch.uint8), "grids": ((n, 2), torch.int64)}
        if self.pack:
            shapes |= {"segments": ((sequences, most), torch.int64), "patch_index": ((sequences, most), torch.int64),
                       "image_slots": ((sequences, slots), torch.int64)}
        return shapes

    def _put_images(self, t: dict[str, torch.Tensor], samples: list[Sample], places, segments) -> None:
        """Each image into its place; zeros only where no image is (the buffers start uninitialized)."""
        pixels = t["pixel_values"]
        if self.patches is None:
            for i, s in enumerate(samples):
                pixels[i] = 0 if s.image is None else s.image
            return
        for i, s in enumerate(samples):
            seq, offset = places[i] if places else (i, 0)
            n = 0 if s.image is None else s.image.shape[0]
            if n:
                pixels[seq, offset:offset + n] = s.image
            if segments is None:
                pixels[i, n:] = 0
        if segments is not None:
            pixels.masked_fill_((segments < 0)[..., None], 0)
        t["grids"].copy_(torch.tensor([s.grid if s.image is not None else (1, 1) for s in samples], dtype=torch.int64))

    def _layout(self, samples: list[Sample]):
        """(places, segments, patch_index, image_slots) of packed images; four Nones unpacked."""
        if not self.pack:
            return None, None, None, None
        sizes = [0 if s.image is None else s.image.shape[0] for s in samples]
        places, segments, patch_index = layout(sizes, self.patches[0])
        return places, segments, patch_index, class_slots(places, sizes, segments.shape[0])

    def text_length(self, longest: int) -> int:
        return min(padded_width(longest, self.pad_multiple), self.max_text_length)

    def __call__(self, samples: list[Sample]) -> Batch:
        n = len(samples)
        length = self.text_length(max(len(s.input_ids) for s in samples))
        places, segments, patch_index, slots = self._layout(samples)
        sequences, width = (n, 0) if slots is None else slots.shape
        t = batch_buffers({
            "ids": ((n,), torch.int64), **self._image_shapes(n, sequences, width),
            "has_image": ((n,), torch.bool), "has_text": ((n,), torch.bool), "input_ids": ((n, length), torch.int64),
            "attention_mask": ((n, length), torch.int64), "source": ((n,), torch.int64),
            **self._teacher_shapes(samples),
        })
        input_ids = np.full((n, length), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((n, length), dtype=np.int64)
        texts = [len(s.input_ids) > 0 for s in samples]
        for i, s in enumerate(samples):
            ids = s.input_ids[:length]
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
        self._put_images(t, samples, places, segments)
        self._put_teacher(t, samples)
        if segments is not None:
            t["segments"].copy_(segments)
            t["patch_index"].copy_(patch_index)
            t["image_slots"].copy_(slots)
        t["ids"].copy_(torch.tensor([s.uid for s in samples], dtype=torch.int64))
        t["has_image"].copy_(torch.tensor([s.image is not None for s in samples], dtype=torch.bool))
        t["has_text"].copy_(torch.tensor(texts, dtype=torch.bool))
        t["input_ids"].copy_(torch.from_numpy(input_ids))
        t["attention_mask"].copy_(torch.from_numpy(attention_mask))
        t["source"].copy_(torch.tensor([s.source for s in samples], dtype=torch.int64))
        images = Images(t.pop("pixel_values"), t.pop("grids", None), t.pop("segments", None), t.pop("patch_index", None),
                        t.pop("image_slots", None))
        teacher = t.pop("teacher_pixel_values", None)
        return Batch(
            images=images, teacher_images=None if teacher is None else Images(teacher, t.pop("teacher_grids", None)),
            **t,
            num_truncated=sum(s.truncated for s in samples),
            counts=(sum(s.image is not None for s in samples), sum(texts)),
            errors=[e for s in samples for e in s.errors],
        )
