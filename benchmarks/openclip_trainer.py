"""vltrain's trainer against OpenCLIP's own (``open_clip_train``): the same ViT CLIP, the same
initial weights, batch, threads and loader workers, on the same shards written by img2dataset.
Prints each side's peak resident memory and its samples/s.

Neither open_clip_train nor img2dataset is a dependency of vltrain; each runs from a throwaway venv:

    python -m venv /tmp/ocv && /tmp/ocv/bin/pip install torch==2.13.0 torchvision open_clip_torch \\
        'webdataset<=0.2.86' braceexpand pandas
    python -m venv /tmp/i2dv && /tmp/i2dv/bin/pip install img2dataset
    PYTHONPATH=src python benchmarks/openclip_trainer.py --openclip-python /tmp/ocv/bin/python \\
        --img2dataset /tmp/i2dv/bin/img2dataset [--precision fp32,bf16] [--steps 250] [--variants auto,glibc,fixed,rounded]

(On a CPU build of torch, torchvision's import fails on its two ``register_fake`` lines for ``nms``
and ``qnms`` in ``torchvision/_meta_registrations.py``; guard them with ``if hasattr(...)`` or a
try.)

What is measured, for each side in a process of its own, one after the other:
- **peak RSS**: the trainer process's ``VmHWM`` (the most it was resident at once), read from
  ``/proc`` every 0.2 s until it exits;
- **peak PSS with the workers**: the largest sum of ``Pss`` over the trainer and its loader worker
  at one sample (shared pages counted once);
- **samples/s**: the batch times the steps from step ``--warm`` to the last, over the time between
  those steps' optimizer updates (vltrain's ``metrics.jsonl`` times; for open_clip_train a global
  optimizer-step hook).

The model: a ViT-16 image tower (128 px, width 256, 6 blocks) and a text tower of OpenCLIP's
vocabulary (49,408 tokens, context 77, width 256, 6 blocks), embedding 256: 22.5M parameters. Its
open_clip config goes in with ``open_clip.add_model_config``; its random initial weights are made
once by open_clip and given to both (vltrain's ``model.init``). vltrain reads captions with
OpenCLIP's tokenizer rebuilt as a ``tokenizer.json`` (``vltrain tokenizer from-openclip``), the
same ids. The shards: shapes images of 96-400 px at several aspect ratios, served on 127.0.0.1 and
downloaded by img2dataset with its defaults (256 px, ``border``), 1,000 samples per shard.
vltrain runs as its command does (``vltrain train``, so on TCMalloc where the system has it);
``--variants auto,glibc`` adds a row on glibc's malloc. A variant may name text shapes after a
``+`` (alone: on the command's own allocator): ``fixed`` pads every caption to 77 tokens as OpenCLIP
does and runs the text tower over the padded batch (the same matmul shapes every step);
``rounded`` packs the text tokens as the default does but rounds their count up to a multiple of
256 (``model.text.pack_multiple``: a few shapes, rather than a new one per batch). So
``--variants auto,glibc,fixed,glibc+rounded`` tells the allocator's share from the shapes'.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "vltrain-bench-vit16-w256"
MODEL_CONFIG = {
    "embed_dim": 256,
    "vision_cfg": {"image_size": 128, "layers": 6, "width": 256, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 6},
}
SIZES = ((400, 300), (300, 225), (180, 240), (256, 256), (96, 96), (320, 160))

OPENCLIP_RUNNER = r"""
import json, sys, time
import torch, open_clip
from torch.optim.optimizer import register_optimizer_step_post_hook
open_clip.add_model_config(sys.argv[1])
times = []
register_optimizer_step_post_hook(lambda opt, args, kwargs: times.append(time.perf_counter()))
from open_clip_train.main import main
main(sys.argv[3:])
with open(sys.argv[2], "w") as f:
    json.dump(times, f)
"""

INIT_WEIGHTS = r"""
import sys, torch, open_clip
open_clip.add_model_config(sys.argv[1])
torch.manual_seed(0)
model = open_clip.create_model(sys.argv[2])
torch.save(model.state_dict(), sys.argv[3])
print(sum(p.numel() for p in model.parameters()))
"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def make_shards(work: Path, count: int, img2dataset: str) -> Path:
    """``count`` shapes images served on 127.0.0.1 and downloaded by img2dataset (written once)."""
    from vltrain.data.tools.synth import describe, render, sample_scene

    out = work / "shards"
    if (out / "00000.tar").exists():
        return out
    www = work / "www"
    www.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(Quiet, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with open(work / "urls.tsv", "w") as f:
        f.write("url\tcaption\n")
        for k in range(count):
            rng = random.Random(k)
            shapes = sample_scene(rng)
            size = SIZES[k % len(SIZES)]
            name = f"{k:06d}.{'png' if k % 3 == 0 else 'jpg'}"
            render(shapes, max(size), rng).resize(size).save(www / name)
            f.write(f"http://127.0.0.1:{server.server_address[1]}/{name}\t{describe(shapes, rng)}\n")
    subprocess.run([img2dataset, f"--url_list={work / 'urls.tsv'}", "--input_format=tsv", "--url_col=url",
                    "--caption_col=caption", "--output_format=webdataset", f"--output_folder={out}",
                    "--processes_count=1", "--thread_count=16", "--number_sample_per_shard=1000",
                    "--distributor=multiprocessing"], check=True, capture_output=True)
    server.shutdown()
    return out


def pattern(shards: Path) -> str:
    return f"{shards}/{{00000..{len(list(shards.glob('*.tar'))) - 1:05d}}}.tar"


class Watch:
    """Samples a process and its children from ``/proc`` until it exits: the process's VmHWM and
    the largest sum of Pss over the tree."""

    def __init__(self, pid: int):
        self.pid, self.hwm_kb, self.pss_kb = pid, 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree(self) -> list[int]:
        pids, k = [self.pid], 0
        while k < len(pids):
            try:
                for task in os.listdir(f"/proc/{pids[k]}/task"):
                    pids += [int(c) for c in Path(f"/proc/{pids[k]}/task/{task}/children").read_text().split()]
            except OSError:
                pass
            k += 1
        return pids

    @staticmethod
    def _field(path: str, name: str) -> int:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(name):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _run(self) -> None:
        while Path(f"/proc/{self.pid}/stat").exists():
            self.hwm_kb = max(self.hwm_kb, self._field(f"/proc/{self.pid}/status", "VmHWM:"))
            self.pss_kb = max(self.pss_kb, sum(self._field(f"/proc/{p}/smaps_rollup", "Pss:")
                                               for p in self._tree()))
            time.sleep(0.2)


def measure(cmd: list[str], env: dict, log: Path) -> tuple[Watch, float]:
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        watch = Watch(proc.pid)
        code = proc.wait()
    watch.thread.join()
    if code:
        raise SystemExit(f"{cmd[0]} exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return watch, time.perf_counter() - start


def rate(times: list[float], steps: list[int], warm: int, batch: int) -> float:
    """Samples/s from the first step at or after ``warm`` to the last (``times[i]`` is when step
    ``steps[i]`` ended)."""
    first = next(i for i, step in enumerate(steps) if step >= warm)
    return (steps[-1] - steps[first]) * batch / (times[-1] - times[first])


def run_openclip(args, work: Path, shards: Path, precision: str) -> dict:
    times_file = work / f"openclip-{precision}-times.json"
    cmd = [args.openclip_python, "-c", OPENCLIP_RUNNER, str(work / f"{MODEL}.json"), str(times_file),
           f"--train-data={pattern(shards)}", "--dataset-type=webdataset",
           f"--train-num-samples={args.steps * args.batch}", f"--batch-size={args.batch}",
           f"--workers={args.workers}", f"--precision={'amp_bf16' if precision == 'bf16' else 'fp32'}",
           f"--model={MODEL}", f"--pretrained={work / 'init.pt'}", "--epochs=1", "--lr=5e-4", "--wd=0.2",
           f"--warmup={args.steps // 10}", "--seed=0", "--device=cpu", "--save-frequency=0", "--log-every-n-steps=50",
           f"--logs={work / 'openclip-logs'}", f"--name={precision}-{time.time_ns()}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("PYTHONPATH", None)
    watch, wall = measure(cmd, env, work / f"openclip-{precision}.log")
    times = json.loads(times_file.read_text())
    return {"hwm": watch.hwm_kb, "pss": watch.pss_kb, "wall": wall,
            "rate": rate(times, list(range(1, len(times) + 1)), args.warm, args.batch)}


SHAPES = {
    # every caption padded to 77 tokens and the text tower run over the padded batch: OpenCLIP's shapes
    "fixed": ["data.pad_multiple=77", "model.text.layout=padded"],
    # the text tokens packed (the default on a CPU), their count rounded up to a multiple of 256
    "rounded": ["model.text.pack_multiple=256"],
}
"""A variant's text shapes (``--variants auto+rounded``), as config overrides."""


def parse_variant(variant: str) -> tuple[str, list[str]]:
    """(VLTRAIN_MALLOC, config overrides) of a variant: ``glibc+rounded``, or ``fixed`` alone (on auto)."""
    allocator, *shapes = variant.split("+")
    if allocator in SHAPES:
        allocator, shapes = "auto", [allocator, *shapes]
    if allocator not in ("auto", "tcmalloc", "glibc") or any(x not in SHAPES for x in shapes):
        raise ValueError(f"--variants: {variant!r} is not auto, tcmalloc or glibc, with +fixed or +rounded, "
                         "nor fixed or rounded alone")
    return allocator, [o for shape in shapes for o in SHAPES[shape]]


def run_vltrain(args, work: Path, shards: Path, precision: str, variant: str) -> dict:
    from vltrain.train.metrics import read_jsonl

    run = work / f"vltrain-{precision}-{variant}"
    shutil.rmtree(run, ignore_errors=True)  # a run folder with a checkpoint would resume
    (work / "empty.yaml").write_text("{}\n")
    vltrain = str(Path(sys.executable).with_name("vltrain"))
    cmd = [vltrain, "train", str(work / "empty.yaml"), f"run.dir={run}",
           f"data.train={pattern(shards)}", "data.val=''", f"data.tokenizer={work / 'tokenizer.json'}",
           f"data.num_workers={args.workers}", f"data.batch_size={args.batch}", f"model.init={work / 'init.pt'}",
           f"train.max_steps={args.steps}", f"train.precision={precision}", f"train.threads={args.threads}",
           "train.lr=5e-4", "train.weight_decay=0.2", f"train.warmup_steps={args.steps // 10}", "train.grad_clip=0",
           "train.log_every=10", "train.progress=false", "checkpoint.every=0", "checkpoint.save_initial=never"]
    allocator, overrides = parse_variant(variant)
    cmd += overrides
    env = {**os.environ, "VLTRAIN_MALLOC": allocator, "PYTHONPATH": str(REPO / "src")}
    watch, wall = measure(cmd, env, work / f"vltrain-{precision}-{variant}.log")
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "samples_per_s" in r]  # the training lines
    return {"hwm": watch.hwm_kb, "pss": watch.pss_kb, "wall": wall,
            "rate": rate([r["time"] for r in rows], [r["step"] for r in rows], args.warm, args.batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--openclip-python", required=True, help="a python with open_clip_train importable")
    ap.add_argument("--img2dataset", default="img2dataset", help="the img2dataset command (to write the shards)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vltrain-vs-openclip"))
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--warm", type=int, default=50, help="steps left out of the rate")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--variants", default="auto", help="vltrain's runs, comma-separated: auto, tcmalloc or glibc "
                    "(VLTRAIN_MALLOC), each optionally +fixed (OpenCLIP's text shapes: padded to 77) or +rounded "
                    "(packed, rounded to 256 tokens); fixed or rounded alone run on auto")
    args = ap.parse_args()
    for variant in args.variants.split(","):
        try:
            parse_variant(variant)
        except ValueError as e:
            ap.error(str(e))
    from vltrain.data.tools.openclip_tokenizer import openclip_tokenizer

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    shards = make_shards(work, args.steps * args.batch, args.img2dataset)
    (work / f"{MODEL}.json").write_text(json.dumps(MODEL_CONFIG))  # open_clip names a config by its file
    params = subprocess.run([args.openclip_python, "-c", INIT_WEIGHTS, str(work / f"{MODEL}.json"), MODEL,
                             str(work / "init.pt")], capture_output=True, text=True, check=True).stdout.split()[-1]
    openclip_tokenizer().save(str(work / "tokenizer.json"))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"{MODEL}: {int(params) / 1e6:.1f}M parameters, batch {args.batch}, {args.steps} steps, "
          f"{args.threads} threads, {args.workers} loader worker(s); {cpu}\n")
    print("| precision | trainer | peak RSS (VmHWM) | peak PSS with workers | samples/s | wall |")
    print("|---|---|---:|---:|---:|---:|")
    for precision in args.precision.split(","):
        results = [("open_clip_train", run_openclip(args, work, shards, precision))]
        for variant in args.variants.split(","):
            results.append((f"vltrain ({variant})", run_vltrain(args, work, shards, precision, variant)))
        for name, r in results:
            print(f"| {precision} | {name} | {r['hwm'] / 1024:,.0f} MiB | {r['pss'] / 1024:,.0f} MiB | "
                  f"{r['rate']:.1f} | {r['wall']:.0f} s |", flush=True)
        base = results[0][1]
        for name, r in results[1:]:
            print(f"|  | {name} / open_clip_train | {r['hwm'] / base['hwm']:.2f}x | {r['pss'] / base['pss']:.2f}x | "
                  f"{r['rate'] / base['rate']:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
