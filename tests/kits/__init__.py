"""Helpers shared by the tests: data files, tiny models, training runs, process launchers.

``pyproject.toml`` puts ``tests/`` on ``sys.path`` (``[tool.pytest.ini_options] pythonpath``), so
a test imports them as ``from kits.runkit import train`` from any folder, and a spawned process
(which inherits the parent's ``sys.path``) unpickles ``kits.multiproc`` functions the same way.
A helper two test modules need lives here, never in one of them.
"""
