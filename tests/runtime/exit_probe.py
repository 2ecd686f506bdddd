"""``vltrain`` as torchrun runs it, then the threads of process groups this rank still has
(tests/runtime/test_exit.py): a clean run must have none by the time the interpreter shuts down.
The threads are read from /proc here, not from vltrain, so that the probe checks vltrain."""

import os
import sys

from vltrain.cli.main import main


def group_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith(("pt_gloo", "gloo_tcp", "pt_nccl")):
            names.append(name)
    return sorted(names)


code = main(sys.argv[1:])
sys.stdout.write(f"rank {os.environ.get('RANK', '0')}: group threads left: {group_threads()}\n")  # one write: ranks share it
sys.stdout.flush()
sys.exit(code)
