"""Fixed-seed CPU loss curves, compared against curves recorded before the code was restructured.

A change that is not meant to change the math must leave these curves bit-identical. Each case
trains a tiny model for a few fp32 steps on one thread and compares every logged loss, per-objective
loss and gradient norm with ``tests/reference_curves.json``. Float arithmetic depends on the CPU's
vector kernels, so the reference is kept per CPU kind (vendor and torch's kernel capability): on the
kind it was recorded on the comparison is exact; on another kind it is within 1e-4 relative.

To record the curves on a new CPU kind (only from code whose math is known good):
``PYTHONPATH=src:tests python tests/train/test_loss_curve.py --record``.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(__file__).with_name("reference_curves.json")
STEPS = 8

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


def run_case(name: str, data: Path, out: Path) -> list[dict]:
    from kits.multiproc import free_port

    nproc, extra = CASES[name]
    overrides = {
        "run.dir": out / name, "data.train": "train.jsonl", "data.val": "''",
        "data.tokenizer": data / "tokenizer.json", "data.image_size": 32, "data.max_text_length": 24,
        "data.num_workers": 0, "data.batch_size": 8, "data.shuffle": True, "train.max_steps": STEPS,
        "train.warmup_steps": 2, "train.lr": 1e-3, "train.log_every": 1, "train.threads": 1,
        "train.precision": "fp32", "train.progress": False, "train.seed": 3, "eval.every": 0, **extra,
    }
    overrides["data.train"] = data / str(overrides["data.train"])
    if nproc == 1:
        cmd = [sys.executable, "-m", "vltrain"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "vltrain"]
    cmd += ["train", str(REPO / "configs" / "demo.yaml"), *(f"{k}={v}" for k, v in overrides.items())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    keep = ("loss", "grad_norm", "logit_scale")
    return [{k: v for k, v in r.items() if k in keep or k.startswith("loss/")} for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("curve-data"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_loss_curve_matches_the_recorded_one(name, data, tmp_path):
    recorded = json.loads(REFERENCE.read_text())
    curve = run_case(name, data, tmp_path)
    assert len(curve) == STEPS
    kind = cpu_kind()
    if name in recorded.get(kind, {}):
        assert curve == recorded[kind][name], f"{name}: the loss curve changed on {kind}"
    else:  # another CPU's kernels: the same math within float reordering
        reference = next(curves[name] for curves in recorded.values() if name in curves)
        for got, want in zip(curve, reference):
            assert got.keys() == want.keys()
            assert [got[k] for k in want] == pytest.approx([want[k] for k in want], rel=1e-4, abs=1e-6)


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = make_data(Path(tmp) / "data")
        curves = {name: run_case(name, data_dir, Path(tmp)) for name in CASES}
    recorded = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    recorded[cpu_kind()] = curves
    REFERENCE.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"recorded {len(curves)} curves for {cpu_kind()} in {REFERENCE}")
