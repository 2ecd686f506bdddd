"""Source patterns: brace expansion (``{00000..00099}``, ``{a,b}``) and telling shards from manifests."""

from __future__ import annotations

import re

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``a/{00000..00002}.tar`` -> three paths; ``{x,y}`` lists too; expanded left to right."""
    m = _RANGE.search(pattern)
    n = _LIST.search(pattern)
    if m and (not n or m.start() < n.start()):
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        parts = [str(v).zfill(width) for v in range(int(lo), int(hi) + step, step)]
        span = m.span()
    elif n:
        parts = n.group(1).split(",")
        span = n.span()
    else:
        return [pattern]
    out: list[str] = []
    for p in parts:
        out.extend(expand_braces(pattern[: span[0]] + p + pattern[span[1] :]))
    return out


def is_shard_pattern(path: str) -> bool:
    return path.endswith(".tar") or ("{" in path and ".tar" in path)
