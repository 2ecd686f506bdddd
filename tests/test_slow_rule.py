"""The rule in conftest.py that marks slow every test that starts a process, on small cases.

The cases are module functions reached through the dict ``CASES``, which the rule does not read
through, so that these tests themselves stay fast.
"""

from __future__ import annotations

import subprocess

import conftest
from kits import runkit


def _global_module():
    subprocess.run(["true"])


def _local_import():
    import subprocess as sp

    sp.Popen(["true"])


def _from_import_in_a_closure():
    from multiprocessing import get_context

    def inner():
        get_context("spawn").Process(target=int).start()

    inner()


def _trains_through_a_kit(shapes, run):
    runkit.ok(runkit.train(shapes, run))


def _reads_a_run_through_a_kit(run):
    return runkit.final_state(run)


def _names_subprocess_only(proc):
    assert isinstance(proc, subprocess.CompletedProcess)
    try:
        raise subprocess.TimeoutExpired("x", 1)
    except subprocess.TimeoutExpired:
        pass


CASES = {f.__name__.strip("_"): f for f in (
    _global_module, _local_import, _from_import_in_a_closure, _trains_through_a_kit, _reads_a_run_through_a_kit,
    _names_subprocess_only)}


def _reaches(name: str) -> bool:
    return conftest._starts_processes(CASES[name], conftest._launchers(), set())


def test_a_call_of_a_process_starter_is_seen_however_it_was_imported():
    assert _reaches("global_module") and _reaches("local_import") and _reaches("from_import_in_a_closure")


def test_a_kit_that_starts_processes_is_read_through():
    assert _reaches("trains_through_a_kit")
    assert not _reaches("reads_a_run_through_a_kit")


def test_naming_the_subprocess_module_without_starting_anything_is_not_slow():
    assert not _reaches("names_subprocess_only")


def test_these_tests_are_not_slow(request):
    assert request.node.get_closest_marker("slow") is None
