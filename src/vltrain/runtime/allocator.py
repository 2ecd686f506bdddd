"""The C heap a CPU run's tensors come from: TCMalloc where the system has it, else glibc's malloc.

A CPU step frees and allocates activations of a slightly different size every step (the text
tower's packed tokens, a new count with every batch's captions). glibc's malloc either hands these
back to the kernel and faults them in zeroed again every step (its default thresholds: 0.57x the
step rate of the alternative on a 2-core AVX2 EPYC) or keeps them (``keep_freed_memory``), and then
its heap fragments: the resident size grew to ten times the memory in use over 3,000 steps. A few
sizes, repeated, do not fragment it (``model.text.pack_multiple``:
``docs/benchmarks/memory.md#what-fragments-glibcs-heap``). TCMalloc (gperftools'
``libtcmalloc_minimal``) reuses freed spans of nearby sizes and hands idle ones back gradually;
there a long run's resident size stays flat and the step is faster
(``docs/benchmarks/memory.md#resident-memory-over-a-run``). PyTorch's own CPU launcher
(``torch.backends.xeon.run_cpu``) preloads it for the same reason.

A C allocator has to be in place before the process's first allocation, so the ``vltrain``
command starts itself again (``exec``: the same process id, arguments and streams) with the
library in ``LD_PRELOAD``. ``VLTRAIN_MALLOC`` chooses: ``auto`` (the default: TCMalloc if found,
else glibc), ``tcmalloc`` (an error if it is not installed) or ``glibc``. An allocator the user
preloaded already is kept.
"""

from __future__ import annotations

import glob
import os
import sys

from vltrain.errors import ConfigError

ENV = "VLTRAIN_MALLOC"
CHOICES = ("auto", "tcmalloc", "glibc")
STARTED = "VLTRAIN_MALLOC_STARTED"
"""Set in the restarted process, so that a library the loader refused cannot restart it again."""
LIBRARIES = ("tcmalloc_minimal", "tcmalloc")
KNOWN = ("tcmalloc", "jemalloc", "mimalloc")
INSTALL = ("install it with your system's package (Debian and Ubuntu: libtcmalloc-minimal4; Fedora: "
           "gperftools-libs; conda: gperftools)")


def choice() -> str:
    """``VLTRAIN_MALLOC``, checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ConfigError(f"{ENV}={value!r}: use one of {', '.join(CHOICES)}")
    return value


def library_dirs() -> list[str]:
    """Where to look, in order: this environment's own ``lib`` (a venv or conda prefix),
    ``LD_LIBRARY_PATH``, then the system's library folders."""
    dirs = [os.path.join(p, "lib") for p in (sys.prefix, os.environ.get("CONDA_PREFIX")) if p]
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/usr/local/lib", "/usr/local/lib64", *sorted(glob.glob("/usr/lib/*-linux-gnu")), "/usr/lib64", "/usr/lib"]
    return list(dict.fromkeys(dirs))


def find_tcmalloc() -> str | None:
    """The TCMalloc library to preload (a versioned ``.so`` is what the packages install), or None."""
    for folder in library_dirs():
        for name in LIBRARIES:
            found = sorted(glob.glob(os.path.join(folder, f"lib{name}.so*")))
            if found:
                return found[0]
    return None


def loaded() -> str:
    """The allocator this process runs on: the name of a known one mapped in, else ``glibc``."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "glibc"
    return next((name for name in KNOWN if f"lib{name}" in maps), "glibc")


def restart_with_tcmalloc() -> None:
    """Start this command again with TCMalloc preloaded, where ``VLTRAIN_MALLOC`` and the system
    allow; returns (doing nothing) otherwise, and in a process that has loaded torch already (a
    fork of one, as a test's fork server makes, must not start the parent's command line again)."""
    wanted = choice()
    if wanted == "glibc" or not sys.platform.startswith("linux") or os.environ.get(STARTED):
        return
    if "torch" in sys.modules:  # it has allocated on glibc already, or this is a fork of a process that had
        return
    preloaded = os.environ.get("LD_PRELOAD", "")
    if any(name in preloaded for name in KNOWN):
        return
    library = find_tcmalloc()
    if library is None:
        if wanted == "tcmalloc":
            raise ConfigError(f"{ENV}=tcmalloc: no TCMalloc library on this system; {INSTALL}, or set {ENV}=glibc")
        return
    env = dict(os.environ, LD_PRELOAD=" ".join(x for x in (library, preloaded) if x), **{STARTED: "1"})
    # TCMalloc reports every allocation over 1 GiB on stderr; a large eval batch is not news
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def describe() -> str:
    """One line for the run's start: which heap, and how to change it."""
    name = loaded()
    if name != "glibc":
        return f"memory allocator: {name} (preloaded; {ENV}=glibc runs on glibc's malloc)"
    if find_tcmalloc():
        return (f"memory allocator: glibc's malloc (TCMalloc is installed: the vltrain command preloads it "
                f"unless {ENV}=glibc)")
    return (f"memory allocator: glibc's malloc (TCMalloc keeps a long run's memory flat and steps faster: {INSTALL}; "
            f"without it, model.text.pack_multiple=64 keeps the text tower's sizes few, which bounds glibc's heap)")
