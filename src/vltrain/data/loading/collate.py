"""Samples -> :class:`Batch`: images stacked as uint8, texts padded to the batch's longest row."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import get_worker_info

from vltrain.data.batch import Batch
from vltrain.data.config import PAD_MULTIPLE, DataConfig, padded_width
from vltrain.data.dataset import Sample
from vltrain.data.image_input import ImageLayout, SquareLayout, image_layout
from vltrain.data.teacher_store import TeacherInputs


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


def _prefixed(prefix: str, shapes: dict) -> dict:
    return {f"{prefix}.{k}": v for k, v in shapes.items()}


def _fields(prefix: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The buffers of ``prefix``'s images, by field name."""
    return {k.split(".", 1)[1]: v for k, v in t.items() if k.startswith(prefix + ".")}


class Collator:
    """Pads text to the longest row rounded up to ``pad_multiple``, capped at ``max_text_length``.

    Padding to the longest row instead of ``max_text_length`` is most of the text-side saving:
    captions are short, so a fixed pad to 77 or 512 computes mostly padding. The budget packer
    must round the same way: the training loader gives both ``DataConfig.resolve().pad_multiple``.
    """

    def __init__(self, pad_id: int, max_text_length: int, images: int | ImageLayout,
                 pad_multiple: int = PAD_MULTIPLE, teacher: TeacherInputs | None = None):
        """``images``: their layout (:func:`image_layout`; an int: square images of that size).
        ``teacher``: the samples carry a distillation teacher's part too (:class:`TeacherInputs`),
        its images in the teacher's own layout."""
        self.pad_id = pad_id
        self.max_text_length = max_text_length
        self.images = SquareLayout(images) if isinstance(images, int) else images
        self.pad_multiple = pad_multiple
        self.teacher = teacher
        self.teacher_images = None if teacher is None or teacher.stores is not None else image_layout(teacher.data)

    @classmethod
    def for_data(cls, pad_id: int, cfg: DataConfig, pad_multiple: int = PAD_MULTIPLE,
                 teacher: TeacherInputs | None = None) -> "Collator":
        """The collator of ``cfg``'s images and captions."""
        return cls(pad_id, cfg.max_text_length, image_layout(cfg), pad_multiple, teacher)

    def _teacher_shapes(self, samples: list[Sample]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        t, n = self.teacher, len(samples)
        if t is None:
            return {}
        if t.stores is not None:
            return {"teacher_image_embeds": ((n, t.width), torch.float32),
                    "teacher_text_embeds": ((n, t.width), torch.float32)}
        longest = max(len(s.teacher_ids) for s in samples)
        length = min(padded_width(max(longest, 1), self.pad_multiple), t.data.max_text_length)
        return {"teacher_input_ids": ((n, length), torch.int64), "teacher_attention_mask": ((n, length), torch.int64),
                **_prefixed("teacher_images", self.teacher_images.shapes(n, None))}

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
        self.teacher_images.put(_fields("teacher_images", t), [s.teacher_image for s in samples],
                                [s.teacher_grid for s in samples], None)
        width = ids.shape[1]
        for i, s in enumerate(samples):
            row = s.teacher_ids[:width]
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
            mask[i, :len(row)] = 1

    def text_length(self, longest: int) -> int:
        return min(padded_width(longest, self.pad_multiple), self.max_text_length)

    def _region_shapes(self, samples: list[Sample]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Buffers for the regions when a row of the batch keeps one: R, the most a row keeps, and the
        phrases padded as captions are. None at all otherwise, so a batch without regions is the
        batch it always was."""
        most = max((len(s.region_ids) for s in samples), default=0)
        if not most:
            return {}
        n, width = len(samples), self.text_length(max(len(ids) for s in samples for ids in s.region_ids))
        return {"images.boxes": ((n, most, 4), torch.float32), "images.box_mask": ((n, most), torch.bool),
                "region_ids": ((n, most, width), torch.int64), "region_attention_mask": ((n, most, width), torch.int64)}

    def _put_regions(self, t: dict[str, torch.Tensor], samples: list[Sample]) -> None:
        """Each row's boxes and phrases, zeros (and padding) past its own."""
        if "region_ids" not in t:
            return
        n, most, width = t["region_ids"].shape
        boxes, ids = np.zeros((n, most, 4), dtype=np.float32), np.full((n, most, width), self.pad_id, dtype=np.int64)
        real, mask = np.zeros((n, most), dtype=bool), np.zeros((n, most, width), dtype=np.int64)
        for i, s in enumerate(samples):
            k = len(s.region_ids)
            if not k:
                continue
            boxes[i, :k], real[i, :k] = s.regions.boxes, True
            for r, phrase in enumerate(s.region_ids):
                phrase = phrase[:width]
                ids[i, r, :len(phrase)], mask[i, r, :len(phrase)] = phrase, 1
        for name, values in (("images.boxes", boxes), ("images.box_mask", real), ("region_ids", ids),
                             ("region_attention_mask", mask)):
            t[name].copy_(torch.from_numpy(values))

    def __call__(self, samples: list[Sample]) -> Batch:
        n = len(samples)
        length = self.text_length(max(len(s.input_ids) for s in samples))
        images = [s.image for s in samples]
        most = samples[0].max_patches  # a step's drawn patch budget, the same for all its samples
        layout = self.images.within(most) if most else self.images
        plan = layout.plan(images)
        t = batch_buffers({
            "ids": ((n,), torch.int64), **_prefixed("images", layout.shapes(n, plan)),
            "has_image": ((n,), torch.bool), "has_text": ((n,), torch.bool), "input_ids": ((n, length), torch.int64),
            "attention_mask": ((n, length), torch.int64), "source": ((n,), torch.int64),
            **self._teacher_shapes(samples), **self._region_shapes(samples),
        })
        input_ids = np.full((n, length), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((n, length), dtype=np.int64)
        texts = [len(s.input_ids) > 0 for s in samples]
        for i, s in enumerate(samples):
            ids = s.input_ids[:length]
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
        layout.put(_fields("images", t), images, [s.grid for s in samples], plan)
        self._put_teacher(t, samples)
        self._put_regions(t, samples)
        t["ids"].copy_(torch.tensor([s.uid for s in samples], dtype=torch.int64))
        t["has_image"].copy_(torch.tensor([s.image is not None for s in samples], dtype=torch.bool))
        t["has_text"].copy_(torch.tensor(texts, dtype=torch.bool))
        t["input_ids"].copy_(torch.from_numpy(input_ids))
        t["attention_mask"].copy_(torch.from_numpy(attention_mask))
        t["source"].copy_(torch.tensor([s.source for s in samples], dtype=torch.int64))
        return Batch.from_tensors(
            t,
            num_truncated=sum(s.truncated for s in samples),
            num_regions_cut=sum(s.regions.cut for s in samples if s.regions is not None),
            num_regions_capped=sum(s.regions.capped for s in samples if s.regions is not None),
            counts=(sum(s.image is not None for s in samples), sum(texts)),
            errors=[e for s in samples for e in s.errors],
        )
