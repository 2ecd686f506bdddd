"""The ``vltrain`` command: its parser, logging, and one clear line for a user's mistake.

The commands' arguments and handlers live in :mod:`vltrain.cli.model_commands` and
:mod:`vltrain.cli.data_commands`.

Handlers take the parsed arguments and return an exit code. A :class:`UserError` (bad config,
bad data, missing file) is printed as one clear message, never as a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from typing import NoReturn

from vltrain.cli import data_commands, model_commands
from vltrain.errors import UserError
from vltrain.runtime import allocator


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vltrain", description="Train vision-language models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_commands.add_parsers(sub)
    data_commands.add_parsers(sub.add_parser("data", help="make, check and convert image-text data"),
                              sub.add_parser("tokenizer", help="train or inspect tokenizers"))
    return p


def _setup_logging() -> None:
    """vltrain's own log lines (epoch remainders, skipped rows) on stderr; INFO on rank 0 only."""
    logger = logging.getLogger("vltrain")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(logging.Formatter("vltrain: %(message)s" if rank == "0" else f"vltrain[rank {rank}]: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == "0" else logging.WARNING)
    logger.propagate = False


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with ``key=value`` overrides accepted anywhere on the line: after an option
    (``vltrain eval RUN --data FILE eval.batch_size=64``) argparse has already closed the
    positional list they belong to, and would call them unrecognized."""
    args, rest = parser.parse_known_args(argv)
    late = [a for a in rest if "=" in a and not a.startswith("-")]
    unknown = [a for a in rest if a not in late]
    if unknown or (late and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or late)}")
    if late:
        args.overrides = list(args.overrides or []) + late
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    _setup_logging()
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0" or getattr(e, "label", "error") == "error":
            where = "" if rank == "0" else f"[rank {rank}]"
            model_commands.say(f"vltrain{where}: {getattr(e, 'label', 'error')}: {e}", sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("vltrain: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The process's way in and out: the ``vltrain`` command and ``python -m vltrain``. First, where
    the system has TCMalloc, the process starts again on it (``vltrain.runtime.allocator``)."""
    try:
        allocator.restart_with_tcmalloc()
    except UserError as e:
        model_commands.say(f"vltrain: error: {e}", sys.stderr)
        leave(e.exit_code)
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except BaseException:  # printed as Python itself would (torch's hook names the rank), then the same exit
        sys.excepthook(*sys.exc_info())
        code = 1
    leave(code)


def leave(code: int | str | None) -> NoReturn:
    """Exit with ``code``; past the interpreter's own shutdown if a process group is still running.

    A clean run has freed its groups by now (``World.close``). A failed one leaves them, since a
    worker may be waiting on a dead peer until the timeout, and so may code that made a group
    itself. Their worker threads can still need the GIL once the interpreter is shutting down,
    and that aborts the process with SIGABRT (``vltrain.runtime.distributed.group_threads``),
    which torchrun and Slurm read as a crash instead of this exit code. So, in that case only:
    the exit handlers run and every stream is flushed (the run's own files were closed before),
    and ``os._exit`` leaves without the interpreter's shutdown.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    code = 0 if code is None else int(code)
    distributed = sys.modules.get("vltrain.runtime.distributed")
    if distributed is None or not distributed.group_threads():
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
