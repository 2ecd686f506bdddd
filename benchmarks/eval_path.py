"""The vltrain modules and packages that ``vltrain eval RUN`` passes through.

Trains a tiny run (32 x 32 shapes, 2 steps of tiny-clip, in a subprocess) unless RUN is given, then
runs the eval command's entry (``vltrain.cli.main.main(["eval", RUN, ...])``) in this process under
``sys.setprofile`` and counts the calls of Python functions per vltrain module (module bodies run
by an import are not counted: the command's imports are done before the trace starts). Prints one
row per module with its calls, then one row per package (``vltrain.eval``, ``vltrain.data.index``)
with its modules and calls. A call counts for the module that defines the function.

    PYTHONPATH=src python benchmarks/eval_path.py [RUN] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path


def tiny_run(root: Path) -> Path:
    """A 2-step tiny-clip run with a val set, trained in a subprocess."""
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    synthesize(root / "shapes", 64, 16, text_only_fraction=0.2, seed=0, image_size=32)
    train_tokenizer(source_texts([str(root / "shapes" / "train.jsonl")]), root / "shapes" / "tokenizer.json",
                    vocab_size=200)
    run, shapes = root / "run", root / "shapes"
    (root / "base.yaml").write_text("{}\n")
    given = {"run.dir": run, "data.train": shapes / "train.jsonl", "data.val": shapes / "val.jsonl",
             "data.tokenizer": shapes / "tokenizer.json", "data.image_size": 32, "data.mean": "[0.5,0.5,0.5]",
             "data.std": "[0.5,0.5,0.5]", "data.max_text_length": 16, "data.batch_size": 4, "data.num_workers": 0,
             "model.preset": "tiny-clip", "train.max_steps": 2, "train.precision": "fp32", "train.threads": 1,
             "train.progress": False, "eval.every": 0, "eval.batch_size": 16}
    cmd = [sys.executable, "-m", "vltrain", "train", str(root / "base.yaml"), *[f"{k}={v}" for k, v in given.items()]]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return run


def trace_eval(run: Path) -> Counter:
    """Calls per vltrain module during the eval command."""
    import vltrain.cli.model_commands  # noqa: F401  (the command's own imports, done before the trace)
    import vltrain.eval.evaluator  # noqa: F401
    from vltrain.cli.main import main

    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name != "<module>":
            name = frame.f_globals.get("__name__", "")
            if name == "vltrain" or name.startswith("vltrain."):
                calls[name] += 1

    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["eval", str(run), "train.threads=1", "--json"])
    finally:
        sys.setprofile(None)
    if code:
        raise SystemExit(f"vltrain eval {run} exited {code}")
    return calls


def report(calls: Counter) -> str:
    packages: dict[str, list[str]] = {}
    for module in calls:
        packages.setdefault(module.rpartition(".")[0] or module, []).append(module)
    lines = [f"{'module':<40} {'calls':>8}"]
    lines += [f"{m:<40} {calls[m]:>8}" for m in sorted(calls)]
    lines += ["", f"{'package':<28} {'modules':>8} {'calls':>8}"]
    lines += [f"{p:<28} {len(ms):>8} {sum(calls[m] for m in ms):>8}" for p, ms in sorted(packages.items())]
    lines += ["", f"{len(calls)} modules in {len(packages)} packages"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a run folder (default: train a tiny one)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="make the tiny run here and keep it")
    args = parser.parse_args()
    if args.run:
        print(report(trace_eval(Path(args.run))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        run = root / "run" if (root / "run" / "checkpoints").is_dir() else tiny_run(root)
        print(report(trace_eval(run)))


if __name__ == "__main__":
    main()
