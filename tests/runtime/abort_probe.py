"""A process whose gloo group is still running when it exits (tests/runtime/test_exit.py).

One plain process, a group of one (``MASTER_ADDR``, ``MASTER_PORT`` set). Imported after the group
exists, ``torch.distributed.nn`` keeps it in its default arguments, so ``destroy_process_group``
leaves its threads running: the case ``vltrain.cli.main.leave`` exits past the interpreter's
shutdown, after the exit handlers. Argument: the exit code, and a file the exit handler writes.
"""

import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo", rank=0, world_size=1)
# after the group: torch.distributed.nn's default arguments keep it (vltrain imports it before)
from vltrain.cli.main import leave  # noqa: E402
from vltrain.runtime.distributed import group_threads  # noqa: E402

dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
atexit.register(lambda: Path(sys.argv[2]).write_text("exit handlers ran\n"))
print(f"group threads: {group_threads()}", end="")  # no line break: leave must flush it
leave(int(sys.argv[1]))
