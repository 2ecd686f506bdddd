"""Many small JSON objects (manifest lines, shards' ``.json`` members) parsed in one call.

``json.loads`` of one array holding them all is twice as fast as a call per object. It may stand
for the calls one by one only when each piece provably holds one object on its own: a piece that
is cut off (a line broken inside a string, ``{"a": [1``) must not be completed by the pieces next
to it and taken for a row.
"""

from __future__ import annotations

import json

import numpy as np

SEPARATOR = b"\n,"
"""What ``loads_objects`` expects between two pieces."""


def loads_objects(joined: bytes, count: int) -> list[dict] | None:
    """The ``count`` objects of ``joined`` (pieces joined by ``SEPARATOR``), each as ``json.loads``
    of its piece would give it; None when that is not sure, or a piece is not an object (then
    parse them one by one).

    Why one parse is sure: strict JSON keeps raw line breaks out of strings, so each separator's
    comma is a real one, and no string runs from one piece into the next. Each piece begins with
    ``{`` (checked), and a comma inside an object is followed by a key, never by ``{``: a separator
    can only stand between the values of an array. With no array but the one around the pieces
    (no ``[`` at all, or no array or object among the values' fields), every separator stands at
    its top level, and ``count`` values there leave no room for any other comma: each piece is
    exactly one value."""
    if not count or not joined.startswith(b"{"):
        return None
    text = np.frombuffer(joined, np.uint8)
    breaks = np.flatnonzero(text[:-1] == ord("\n"))  # bytes.count is slower than this
    separators = breaks[text[breaks + 1] == ord(",")]
    if len(separators) != count - 1 or (text[np.minimum(separators + 2, len(text) - 1)] != ord("{")).any():
        return None  # a piece that does not begin with {, or holds a separator
    try:
        values = json.loads(f"[{joined.decode('utf-8')}]")
    except (ValueError, UnicodeDecodeError):  # strict, as one by one
        return None
    if len(values) != count or set(map(type, values)) != {dict}:
        return None
    if b"[" in joined and any(type(x) in (list, dict) for v in values for x in v.values()):
        return None
    return values
