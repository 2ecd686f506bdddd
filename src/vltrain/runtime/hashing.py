"""The counter-based hash that keyed draws are made of: a random number computed from what it is
for (the seed, a step, a sample) rather than drawn from a generator's state, so that any rank,
micro-batch or loader worker computes the same one, and a resumed run too.

It is the 32-bit "lowbias32" integer mixer, in int64 arithmetic that never overflows: the same bits
on Python ints and on int64 tensors, on the CPU and on any GPU. It sits this low because the
objectives' draws (:mod:`vltrain.objectives.keyed`) and the loader's (a step's patch budget,
:mod:`vltrain.data.loading.loader`) are made of it, and the data layer imports no objective.
"""

from __future__ import annotations

MASK32 = 0xFFFF_FFFF
_MIX = (0x7FEB352D, 0x846CA68B)


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), in pieces small enough for int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x):
    """lowbias32: a bijection of [0, 2**32) whose output bits each depend on every input bit.
    Works on Python ints and on int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX[1])
    return x ^ (x >> 16)
