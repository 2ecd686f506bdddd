"""``open_source``: the one entry from a path to a :class:`Source`, above both source kinds.

It sits in a module of its own so that imports point one way: ``sources`` (manifests and the
row types) <- ``shards`` (tar shards) <- ``open`` <- the dataset, ``validate`` and the tokenizer.
"""

from __future__ import annotations

import os

from vltrain.data.config import CsvConfig
from vltrain.data.sources.manifests import Source, open_manifest
from vltrain.data.sources.patterns import is_shard_pattern
from vltrain.data.sources.shards import ShardSource


def open_source(
    path: str, csv_cfg: CsvConfig | None = None, cache_dir: str | os.PathLike | None = None
) -> Source:
    """A manifest (.jsonl/.csv/.tsv) or a shard pattern ('shards/{00000..00009}.tar')."""
    if is_shard_pattern(path):
        return ShardSource(path, cache_dir=cache_dir)
    return open_manifest(path, csv_cfg)
