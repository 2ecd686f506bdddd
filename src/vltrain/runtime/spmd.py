"""A flight recorder of the collectives each rank issues, and the SPMD check built on it.

Every collective vltrain issues itself goes through :func:`vltrain.runtime.distributed.issue`, which tells
the recorder its operation, dtype and the shape each rank sends. The recorder always counts the
bytes (``benchmarks/comm_cost.py`` reads them). With ``train.debug_spmd: true`` it also checks:
before each collective the ranks exchange a fixed-size descriptor (a fingerprint folded from
every collective of the step so far, the collective's number in the step, its operation, dtype
and shape) and compare them. Because the descriptor has the same size on every rank, the check
itself cannot mismatch: a divergence is named before the diverging collective runs, so every rank
stops with the same message instead of a gloo size error on one and a hang on the others (NCCL).

The collectives DDP and FSDP2 issue inside the backward are driven by the module graph, which is
the same on every rank by the model's contract (every module runs every step); they are not
recorded. A step's end is checked too, so a rank that issues one collective more than the others
is caught at the step boundary.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from vltrain.errors import UserError

MAX_DIMS = 6
_OPS = ["all_gather", "all_reduce", "reduce_scatter", "broadcast", "barrier", "ring_pass", "step_end", "shapes"]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8]


class SPMDError(UserError):
    """The ranks issued different collectives: a bug in vltrain, found before it could hang."""

    exit_code = 4


@dataclass
class Issued:
    """One collective as a rank issued it: what the SPMD check compares."""

    op: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.op in ("step_end", "barrier"):
            return self.op.replace("_", " ")
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "?"
        return f"{self.op} of {dtype}[{', '.join(map(str, self.shape))}]"


def _code(items: list, item) -> int:
    return items.index(item) if item in items else len(items)


@dataclass
class Recorder:
    """Counts every collective's bytes; with ``checking`` compares ranks before each one."""

    checking: bool = False
    where: str = "outside a training step"
    index: int = 0
    fingerprint: int = 0
    bytes_sent: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def begin(self, where: str) -> None:
        """A new step (or evaluation) starts: collectives are numbered from 1 again."""
        self.where, self.index, self.fingerprint = where, 0, 0

    def end(self, device: torch.device | str = "cpu") -> None:
        """With checking on, the ranks confirm they issued the same collectives in this step."""
        if self.checking and _world() > 1:
            self._compare(Issued("step_end"), device)

    def before(self, issued: Issued, sent: int, device: torch.device | str = "cpu") -> None:
        """Called by :func:`vltrain.runtime.distributed.issue` just before the collective runs."""
        self.bytes_sent[issued.op] += sent
        self.calls[issued.op] += 1
        if self.checking and _world() > 1:
            self._compare(issued, device)

    def reset_counts(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()

    def _descriptor(self, issued: Issued) -> list[int]:
        shape = list(issued.shape[:MAX_DIMS]) + [-1] * (MAX_DIMS - min(len(issued.shape), MAX_DIMS))
        return [self.fingerprint, self.index, _code(_OPS, issued.op), _code(_DTYPES, issued.dtype),
                len(issued.shape), *shape]

    def _compare(self, issued: Issued, device: torch.device | str) -> None:
        self.index += 1
        mine = torch.tensor(self._descriptor(issued), dtype=torch.int64, device=device)
        table = [torch.empty_like(mine) for _ in range(_world())]
        dist.all_gather(table, mine)
        rows = [t.tolist() for t in table]
        self.fingerprint = _fold(self.fingerprint, rows[dist.get_rank()])
        other = next((r for r in range(1, len(rows)) if rows[r] != rows[0]), None)
        if other is not None:
            raise SPMDError(self._message(rows[0], rows[other], other))

    def _message(self, first: list[int], second: list[int], other: int) -> str:
        what = f"collective #{first[1]} of the step" if first[1] == second[1] else "the collective count"
        if first[0] != second[0] and first[2:] == second[2:]:
            what = f"a collective before #{first[1]}"
        return (f"SPMD check (train.debug_spmd): the ranks diverged {self.where} at {what}: rank 0 issued "
                f"{_decode(first).describe()}, rank {other} issued {_decode(second).describe()}. Every rank "
                "must issue the same collectives with the same shapes; this is a bug in vltrain, please "
                "report it with this line and the config (config.yaml in the run folder).")


def _decode(row: list[int]) -> Issued:
    op = _OPS[row[2]] if row[2] < len(_OPS) else "unknown"
    dtype = _DTYPES[row[3]] if row[3] < len(_DTYPES) else None
    return Issued(op, dtype, tuple(row[5 : 5 + min(row[4], MAX_DIMS)]))


def _fold(fingerprint: int, row: list[int]) -> int:
    digest = hashlib.blake2b(repr((fingerprint, row)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits an int64


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


RECORDER = Recorder()
"""The process's recorder: one per process, as there is one default process group."""
