"""Per-sample metadata the sampler needs without decoding anything."""

from __future__ import annotations

from typing import Callable

import numpy as np

MANIFEST_BLOCK = 4096
"""Rows of a manifest that count as one block of the windowed shuffle."""


class SampleTable:
    """Columns over a dataset's index space ``0..n-1``.

    Built once from the sources' sample indexes. Every rank builds the same table from the same
    files, so a schedule computed from it is identical on every rank without any communication.

    ``text_len`` may be given as a function: caption token counts cost a tokenizer pass over every
    caption, which only budget batching needs, so they are computed on first use. So may
    ``patches``: every image's patch count at its own shape costs a read of every image's header,
    which only a patch budget needs.
    """

    def __init__(self, has_image: np.ndarray, has_text: np.ndarray,
                 text_len: np.ndarray | Callable[[], np.ndarray], source: np.ndarray,
                 blocks: np.ndarray | None = None, patches: np.ndarray | Callable[[], np.ndarray] | None = None):
        self.has_image = has_image  # bool [n]
        self.has_text = has_text  # bool [n]
        self._text_len = text_len
        self._patches = patches
        self.source = source  # int16 [n], index of the source in a mixture (0 for a single source)
        self.blocks = blocks
        """Starts of the rows that are read together (a tar shard), then n: the windowed shuffle's
        unit (``data.shuffle_window``). None: runs of manifest rows."""

    @property
    def text_len(self) -> np.ndarray:
        """int [n] (uint16 from a sample index): tokens incl. special tokens, capped at
        max_text_length; 0 without text."""
        if callable(self._text_len):
            self._text_len = self._text_len()
        return self._text_len

    @property
    def has_lengths(self) -> bool:
        """The token counts are at hand (no tokenizer pass needed to read them)."""
        return not callable(self._text_len)

    @property
    def patches(self) -> np.ndarray:
        """int [n]: the patches each row's image becomes at its own shape (``data.resize: native``),
        0 without an image. Raises where images are resized to one square size."""
        if self._patches is None:
            raise ValueError("patch counts exist for images at their own shape only (data.resize: native)")
        if callable(self._patches):
            self._patches = self._patches()
        return self._patches

    @property
    def pending(self) -> bool:
        """A column is still a function to call (a table that cannot be pickled as it is)."""
        return callable(self._text_len) or callable(self._patches)

    def __len__(self) -> int:
        return int(self.has_image.shape[0])


def default_blocks(n: int) -> np.ndarray:
    """Block starts (then ``n``) of a source without shards: runs of ``MANIFEST_BLOCK`` rows."""
    return np.r_[np.arange(0, n, MANIFEST_BLOCK, dtype=np.int64), n]
