"""Samples -> :class:`Batch`: images stacked as uint8, texts padded to the batch's longest row."""

from __future__ import annotations

import numpy as np
import torch

from vltrain.data.batch import Batch
from vltrain.data.config import PAD_MULTIPLE, padded_width
from vltrain.data.dataset import Sample


class Collator:
    """Pads text to the longest row rounded up to ``pad_multiple``, capped at ``max_text_length``.

    Padding to the longest row instead of ``max_text_length`` is most of the text-side saving:
    captions are short, so a fixed pad to 77 or 512 computes mostly padding. The budget packer
    must round the same way: the training loader gives both ``DataConfig.resolve().pad_multiple``.
    """

    def __init__(self, pad_id: int, max_text_length: int, image_size: int, pad_multiple: int = PAD_MULTIPLE):
        self.pad_id = pad_id
        self.max_text_length = max_text_length
        self.image_size = image_size
        self.pad_multiple = pad_multiple

    def text_length(self, longest: int) -> int:
        return min(padded_width(longest, self.pad_multiple), self.max_text_length)

    def __call__(self, samples: list[Sample]) -> Batch:
        n = len(samples)
        length = self.text_length(max(len(s.input_ids) for s in samples))
        input_ids = np.full((n, length), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((n, length), dtype=np.int64)
        pixel_values = torch.empty((n, 3, self.image_size, self.image_size), dtype=torch.uint8)
        has_image = torch.zeros(n, dtype=torch.bool)
        texts = [len(s.input_ids) > 0 for s in samples]
        for i, s in enumerate(samples):
            ids = s.input_ids[:length]
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
            if s.image is not None:
                pixel_values[i] = s.image
                has_image[i] = True
            else:
                pixel_values[i] = 0
        return Batch(
            ids=torch.tensor([s.uid for s in samples], dtype=torch.int64),
            pixel_values=pixel_values,
            has_image=has_image,
            has_text=torch.tensor(texts, dtype=torch.bool),
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attention_mask),
            source=torch.tensor([s.source for s in samples], dtype=torch.int64),
            num_truncated=sum(s.truncated for s in samples),
            counts=(sum(s.image is not None for s in samples), sum(texts)),
            errors=[e for s in samples for e in s.errors],
        )
