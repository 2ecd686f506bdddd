"""Per-sample metadata the sampler needs without decoding anything."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SampleTable:
    """Columns over a dataset's index space ``0..n-1``.

    Built once from the manifest or shard index (captions are tokenized once, in bulk, for
    ``text_len``). Every rank builds the same table from the same files, so a schedule
    computed from it is identical on every rank without any communication.
    """

    has_image: np.ndarray  # bool [n]
    has_text: np.ndarray  # bool [n]
    text_len: np.ndarray  # int [n] (uint16 from a sample index), tokens incl. special tokens, capped; 0 if no text
    source: np.ndarray  # int16 [n], index of the source in a mixture (0 for a single source)
    blocks: np.ndarray | None = None
    """Starts of the rows that are read together (a tar shard), then n: the windowed shuffle's
    unit (``data.shuffle_window``). None: runs of manifest rows."""

    def __len__(self) -> int:
        return int(self.has_image.shape[0])
