"""Runtime settings that depend on the machine."""

from __future__ import annotations

from vltrain.runtime.world import cpu_has_bf16_matmul


def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n")
    return str(path)


def test_bf16_matmul_needs_avx512_bf16_or_amx(tmp_path):
    assert not cpu_has_bf16_matmul(_cpuinfo(tmp_path, "fma avx512f"))  # AVX-512 alone emulates bf16
    assert cpu_has_bf16_matmul(_cpuinfo(tmp_path, "avx512f avx512_bf16"))
    assert cpu_has_bf16_matmul(_cpuinfo(tmp_path, "amx_bf16 amx_tile"))
    assert cpu_has_bf16_matmul(str(tmp_path / "missing"))  # unknown: keep the config's choice


def test_threads_default_to_the_cpus_this_process_may_use_not_the_machines():
    """Under taskset or Slurm's --cpus-per-task a process may run on fewer CPUs than the machine has:
    one thread per allowed CPU, not per CPU of the machine (which oversubscribes the allowed ones)."""
    import os

    import torch

    from vltrain.runtime.cpus import usable_cpus
    from vltrain.runtime.world import setup_world

    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert usable_cpus() == 1
        setup_world(device="cpu", threads=0)
        assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
    assert usable_cpus() == len(allowed)
