"""Fixed-seed CPU loss curves, compared against curves recorded before the code was restructured.

A change that is not meant to change the math must leave these curves bit-identical. Each case
trains a tiny model for a few steps on one thread and compares every logged loss, per-objective
loss and gradient norm with a recorded curve, twice:

- **fp32, exactly, on the CPU kinds recorded** (``reference_curves.json``, per vendor and torch's
  kernel capability). fp32 results differ between kinds well beyond a ulp: torch's vectorized
  normal and uniform kernels draw other initial weights than its scalar ones (up to 5e-7
  relative), FMA rounds pixel normalization otherwise, and matmuls sum in other orders; two
  recorded kinds differ by up to 1.3e-3 relative at step 8. So a kind not recorded is not compared
  in fp32: no tolerance picked there would both pass every kind and catch a small change.
- **fp64, on every kind** (``reference_curves_fp64.json``, one curve per case). With
  ``train.precision=fp64`` the weights are drawn in fp64 and everything after is fp64, so kinds
  differ only by fp64's rounding. The file records two measurements and the tolerance follows from
  them: ``noise``, the largest relative difference between the curves of several kernel
  configurations (torch's AVX2 and scalar kernels, MKL's paths), and ``smallest_change``, the
  smallest effect of the smallest change the math can take (one element of one initial weight
  moved by one fp32 ulp; each case's largest relative difference, the least of them). The
  tolerance is their geometric mean: as far in ratio above the noise as below that change.

To record the fp32 curves of a new CPU kind (only from code whose math is known good):
``PYTHONPATH=src:tests python tests/train/test_loss_curve.py --record``. To record the fp64 curves
and both measurements anew (after a change to the math on purpose, or a new torch):
``PYTHONPATH=src:tests python tests/train/test_loss_curve.py --record-fp64``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(__file__).with_name("reference_curves.json")
REFERENCE_FP64 = Path(__file__).with_name("reference_curves_fp64.json")
PERTURBED = Path(__file__).with_name("perturbed_run.py")
STEPS = 8
FP64_CONFIGURATIONS: dict[str, dict[str, str]] = {
    "native": {},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL_CBWR=AVX": {"MKL_CBWR": "AVX"},
    "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}
"""Kernel configurations of one machine whose fp64 curves measure fp64's noise between kinds:
torch's vectorized or scalar kernels, MKL's AVX or its most portable path."""

# Each case: the number of processes and overrides of configs/demo.yaml (data.train relative to the data).
CASES: dict[str, tuple[int, dict[str, object]]] = {
    "albef-itc-itm-mlm": (1, {
        "model.preset": "tiny-albef", "model.loss.itm": 0.5, "model.loss.mlm": 0.3,
        "data.modality_weights.text_only": 0.5,
    }),
    "clip-itc-siglip-gradcache": (1, {
        "model.preset": "tiny-clip", "model.loss.siglip": 0.5, "train.accumulation": 2,
        "train.contrastive_accumulation": "gradcache", "data.batch_size": 6,
    }),
    "albef-two-ranks-global-negatives-ring": (2, {
        "model.preset": "tiny-albef", "model.loss.itm_negatives": "global",
        "model.loss.contrastive_impl": "ring", "data.batch_size": 6, "data.batching": "budget",
    }),
    # Images at their own shape (native.jsonl: wide, tall and square), padded and packed.
    "clip-native-padded-siglip": (1, {
        "model.preset": "tiny-clip", "model.loss.siglip": 0.5, "data.train": "native.jsonl",
        "data.resize": "native", "data.max_patches": 8,
    }),
    "clip-native-packed": (1, {
        "model.preset": "tiny-clip", "data.train": "native.jsonl", "data.resize": "native",
        "data.max_patches": 8, "data.pack_images": True,
    }),
    "albef-native-padded-itm-mlm-mim": (1, {
        "model.preset": "tiny-albef", "model.loss.itm": 0.5, "model.loss.mlm": 0.3,
        "model.loss.image_mim": 0.5, "data.train": "native.jsonl", "data.resize": "native",
        "data.max_patches": 8,
    }),
    "albef-native-packed-itm-mlm-mim": (1, {
        "model.preset": "tiny-albef", "model.loss.itm": 0.5, "model.loss.mlm": 0.3,
        "model.loss.image_mim": 0.5, "data.train": "native.jsonl", "data.resize": "native",
        "data.max_patches": 8, "data.pack_images": True,
    }),
}
NATIVE_SIZES = [(64, 16), (16, 64), (32, 32), (48, 24), (24, 48), (40, 8), (8, 40), (96, 32)]
"""(width, height) of native.jsonl's images, in turn."""


def cpu_kind() -> str:
    import torch

    vendor = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        vendor = platform.processor()
    return f"{vendor or 'unknown'}-{torch.backends.cpu.get_cpu_capability()}-torch{torch.__version__}"


def make_data(root: Path) -> Path:
    """Shapes with 20% text-only rows, and every seventh image-text row made image-only; native.jsonl
    is the same rows with each image resized to one of NATIVE_SIZES."""
    from PIL import Image

    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    if (root / "tokenizer.json").exists():
        return root
    synthesize(root, 96, 0, text_only_fraction=0.2, seed=0, image_size=32)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        if i % 7 == 3 and "image" in row:
            del row["text"]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "native").mkdir()
    for i, row in enumerate(rows):
        if "image" in row:
            image = Image.open(root / row["image"]).resize(NATIVE_SIZES[i % len(NATIVE_SIZES)], Image.Resampling.BICUBIC)
            row["image"] = f"native/{i}.png"
            image.save(root / row["image"])
    (root / "native.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=200)
    return root


def run_case(name: str, data: Path, out: Path, precision: str = "fp32", change: str | None = None,
             env: dict[str, str] | None = None) -> list[dict]:
    """The case's curve in ``precision``; with ``change``, through ``perturbed_run.py`` with that
    change to the math; ``env`` added to the run's environment."""
    from kits.multiproc import free_port
    from kits.runkit import finish, launch

    nproc, extra = CASES[name]
    overrides = {
        "run.dir": out / name, "data.train": "train.jsonl", "data.val": "''",
        "data.tokenizer": data / "tokenizer.json", "data.image_size": 32, "data.max_text_length": 24,
        "data.num_workers": 0, "data.batch_size": 8, "data.shuffle": True, "train.max_steps": STEPS,
        "train.warmup_steps": 2, "train.lr": 1e-3, "train.log_every": 1, "train.threads": 1,
        "train.precision": precision, "train.progress": False, "train.seed": 3, "eval.every": 0, **extra,
    }
    overrides["data.train"] = data / str(overrides["data.train"])
    argv = ["train", str(REPO / "configs" / "demo.yaml"), *(f"{k}={v}" for k, v in overrides.items())]
    if change is None and env is None:  # forked from a process that has imported vltrain (kits.forkrun)
        proc = finish(launch(argv, nproc, cwd=REPO), 300)
    else:  # another program, or an environment read as torch loads: a process of its own
        program = ["-m", "vltrain"] if change is None else [str(PERTURBED), change]
        cmd = [sys.executable, *program] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *program]
        proc = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    keep = ("loss", "grad_norm", "logit_scale")
    return [{k: v for k, v in r.items() if k in keep or k.startswith("loss/")} for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("curve-data"))


def largest_difference(curve: list[dict], reference: list[dict]) -> tuple[float, str]:
    """The largest relative difference between two curves of the same case, and where it is."""
    assert len(curve) == len(reference) and all(a.keys() == b.keys() for a, b in zip(curve, reference))
    worst, where = 0.0, "nowhere"
    for step, (got, want) in enumerate(zip(curve, reference), start=1):
        for key, value in want.items():
            d = abs(got[key] - value) / max(abs(value), 1e-300)
            if d > worst or math.isnan(d):
                worst, where = d, f"step {step} {key}: {got[key]!r} against {value!r}"
    return worst, where


def fp64_tolerance(recorded: dict) -> float:
    """The geometric mean of the recorded noise and smallest change (see the module docstring)."""
    return math.sqrt(recorded["noise"] * recorded["smallest_change"])


@pytest.fixture(scope="module")
def fp64() -> dict:
    recorded = json.loads(REFERENCE_FP64.read_text())
    import torch

    if recorded["torch"] != torch.__version__.split("+")[0]:
        pytest.skip(f"the fp64 curves were recorded with torch {recorded['torch']}, this is {torch.__version__}")
    return recorded


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_loss_curve_matches_the_recorded_one(name, data, tmp_path):
    kind = cpu_kind()
    recorded = json.loads(REFERENCE.read_text()).get(kind, {})
    if name not in recorded:
        pytest.skip(f"no fp32 curve of {name} recorded on {kind}: its fp64 curve is checked; record "
                    "this kind with `PYTHONPATH=src:tests python tests/train/test_loss_curve.py --record`")
    curve = run_case(name, data, tmp_path)
    assert curve == recorded[name], f"{name}: the loss curve changed on {kind}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_fp64_loss_curve_matches_the_recorded_one_on_every_kind(name, data, tmp_path, fp64):
    worst, where = largest_difference(run_case(name, data, tmp_path, "fp64"), fp64["curves"][name])
    tolerance = fp64_tolerance(fp64)
    assert worst <= tolerance, f"{name} in fp64 on {cpu_kind()}: {worst:.2e} relative at {where} (tolerance {tolerance:.2e})"


def test_the_fp64_tolerance_separates_the_noise_from_the_smallest_change(fp64):
    """Both recorded measurements at least 10x from the tolerance, on its two sides."""
    tolerance = fp64_tolerance(fp64)
    assert fp64["noise"] * 10 <= tolerance <= fp64["smallest_change"] / 10
    assert set(fp64["configurations"]) == set(FP64_CONFIGURATIONS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("change", "name"), [("init-ulp-one", "clip-native-packed"),
                                              ("mask", "clip-native-padded-siglip")])
def test_the_fp64_check_fails_a_one_ulp_init_change_and_a_changed_mask(change, name, data, tmp_path, fp64):
    """One fp32 ulp on one element of the patch embedding's initial weight, or one patch fewer in
    each image's attention mask: the fp64 curve leaves the tolerance."""
    worst, where = largest_difference(run_case(name, data, tmp_path, "fp64", change), fp64["curves"][name])
    assert worst > fp64_tolerance(fp64), f"{change} on {name} went unseen: {worst:.2e} at {where}"


def record_fp64(data_dir: Path, tmp: Path) -> dict:
    """Every case's fp64 curve in each of FP64_CONFIGURATIONS, and once with one init element moved
    by an fp32 ulp: the curves (native kernels) and the two measurements the tolerance rests on."""
    import torch

    runs = {label: {name: run_case(name, data_dir, tmp / f"configuration-{i}", "fp64", env=env) for name in CASES}
            for i, (label, env) in enumerate(FP64_CONFIGURATIONS.items())}
    curves = runs["native"]
    noise = max(largest_difference(run[name], curves[name])[0] for run in runs.values() for name in CASES)
    nudged = {name: largest_difference(run_case(name, data_dir, tmp / "nudged", "fp64", "init-ulp-one"),
                                       curves[name])[0] for name in CASES}
    return {"torch": torch.__version__.split("+")[0], "recorded_on": cpu_kind(),
            "configurations": list(FP64_CONFIGURATIONS), "noise": noise, "smallest_change": min(nudged.values()),
            "one_ulp_change_per_case": nudged, "curves": curves}


if __name__ == "__main__" and {"--record", "--record-fp64"} & set(sys.argv):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = make_data(Path(tmp) / "data")
        if "--record-fp64" in sys.argv:
            fp64_record = record_fp64(data_dir, Path(tmp))
            REFERENCE_FP64.write_text(json.dumps(fp64_record, indent=1) + "\n")
            print(f"recorded fp64 curves: noise {fp64_record['noise']:.2e}, smallest change "
                  f"{fp64_record['smallest_change']:.2e}, tolerance {fp64_tolerance(fp64_record):.2e}")
        if "--record" in sys.argv:
            curves = {name: run_case(name, data_dir, Path(tmp)) for name in CASES}
            recorded = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
            recorded[cpu_kind()] = curves
            REFERENCE.write_text(json.dumps(recorded, indent=1) + "\n")
            print(f"recorded {len(curves)} curves for {cpu_kind()} in {REFERENCE}")
