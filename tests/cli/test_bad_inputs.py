"""Bad input, as a new user or an adversary types it, through the real command line: each case gets its
exit code under the one rule (2: the command or its config cannot be run as written; 1: it could,
but what it read or did failed), exactly one error line with no traceback, the words that name the
problem, and no file the user had changed (every file of the runs, exports and data is hashed before
and after). The table is ``docs/errors.md``'s; every case's id is a row there."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image
from kits import forkrun
from kits.hubkit import commit_of, put
from kits.runkit import ok, overrides, session_shapes, train

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
STEPS = 2


@dataclass
class Case:
    id: str
    argv: list[str]
    """``{name}`` is a path of :func:`kit`; ``TRAIN`` is ``train BASE.yaml`` and the tiny run's overrides,
    into a fresh run folder."""
    code: int
    words: list[str]


CASES = [
    # config errors: refused before anything is built (exit 2)
    Case("loss-weight-without-its-head", ["TRAIN", "model.loss.caption=2", "model.loss.itm=1"], 2,
         ["model.loss.caption=2 needs a captioning decoder", "model.loss.itm=1 needs a fusion encoder",
          "tiny-clip has not"]),
    Case("locca-weight-without-a-locca-decoder", ["TRAIN", "model.preset=tiny-coca", "model.loss.referring=1"], 2,
         ["model.loss.referring=1 needs a LocCa decoder", "tiny-coca has not", "tiny-siglip2"]),
    Case("teacher-settings-without-a-teacher", ["TRAIN", "model.teacher.precomputed=true"], 2,
         ["model.teacher.precomputed=true", "names no teacher"]),
    Case("yaml-key-given-twice", ["train", "{twice}"], 2, ["twice.yaml, line", "'model' is given twice"]),
    Case("unknown-config-key", ["TRAIN", "model.los.itc=1"], 2, ["unknown config key 'model.los.itc'",
                                                                  "did you mean model.loss.itc"]),
    Case("config-value-of-the-wrong-type", ["TRAIN", "train.lr=abc"], 2, ["'train.lr' expects float"]),
    Case("negative-loss-weight", ["TRAIN", "model.loss.itc=-1"], 2, ["model.loss.itc must be >= 0"]),
    Case("unknown-preset", ["TRAIN", "model.preset=nope"], 2, ["unknown preset 'nope'"]),
    Case("config-file-missing", ["train", "{nowhere}.yaml"], 2, ["nowhere.yaml does not exist"]),
    Case("teacher-missing-in-train", ["TRAIN", "model.loss.distill=1", "model.teacher.path={nowhere}"], 2,
         ["model.teacher.path", "does not exist"]),
    Case("unknown-model-type-as-init", ["TRAIN", "model.init={bert}"], 2, ["model_type 'bert'", "BLIP"]),
    Case("hub-name-malformed", ["TRAIN", "model.init=hf-hub:clip-vit-b32"], 2,
         ["model.init 'hf-hub:clip-vit-b32' is not a Hub model name", "hf-hub:ORG/NAME@REVISION"]),
    # usage errors: flags out of range, paths that are no model (exit 2)
    Case("caption-batch-size-0", ["caption", "{run}", "--images", "{image}", "--batch-size", "0"], 2,
         ["--batch-size", "at least 1, got 0"]),
    Case("caption-batch-size-negative", ["caption", "{run}", "--images", "{image}", "--batch-size", "-1"], 2,
         ["--batch-size", "at least 1, got -1"]),
    Case("caption-top-p-0", ["caption", "{run}", "--images", "{image}", "--top-p", "0"], 2,
         ["--top-p", "in (0, 1], got 0"]),
    Case("caption-top-p-above-1", ["caption", "{run}", "--images", "{image}", "--top-p", "1.5"], 2,
         ["--top-p", "in (0, 1], got 1.5"]),
    Case("caption-max-length-0", ["caption", "{run}", "--images", "{image}", "--max-length", "0"], 2,
         ["--max-length", "at least 1, got 0"]),
    Case("caption-box-not-four-numbers", ["caption", "{run}", "--images", "{image}", "--boxes", "1,2"], 2,
         ["--boxes '1,2'", "x0,y0,x1,y1"]),
    Case("ground-texts-do-not-pair-with-images", ["ground", "{run}", "--images", "{image}", "{image}", "--texts", "x",
                                                  "y", "z"], 2, ["--images gives 2 and --texts 3"]),
    Case("referring-set-without-a-locca-decoder", ["eval", "{run}", "--referring", "{image}"], 2,
         ["eval.referring needs a LocCa decoder"]),
    Case("dense-mask-of-another-size", ["eval", "{run}", "--dense", "{dense}"], 1,
         ["dense.jsonl:1: mask", "is 16x16 but its image", "is 32x32"]),
    Case("caption-beam-0", ["caption", "{run}", "--images", "{image}", "--beam", "0"], 2, ["--beam must be >= 1"]),
    Case("embed-nothing-to-embed", ["embed", "{export}", "--out", "{nowhere}.npy"], 2, ["nothing to embed"]),
    Case("teacher-missing-in-teacher-embed", ["data", "teacher-embed", "{nowhere}", "{data}"], 2,
         ["teacher", "does not exist"]),
    Case("eval-path-missing", ["eval", "{nowhere}"], 2, ["does not exist"]),
    Case("export-of-a-file-that-is-no-model", ["export", "{twice}", "--out", "{nowhere}"], 2,
         ["is a file but not a checkpoint file"]),
    Case("unknown-model-type", ["eval", "{bert}", "--data", "{data}"], 2,
         ["model_type 'bert'", "Siglip2Model and BLIP"]),
    Case("hub-repository-of-no-model", ["embed", "hf-hub:org/data", "--texts", "x", "--out", "{nowhere}.npy"], 2,
         ["hf-hub:org/data (commit", "holds neither", "it holds README.md, train.csv"]),
    Case("from-coco-instances-missing", ["data", "from-coco", "--instances", "{nowhere}.json", "--images", "{images}",
                                         "--out", "{nowhere}.jsonl"], 2, ["--instances", "nowhere.json: not found"]),
    # failures at run time: the command could run, what it read could not be used (exit 1)
    Case("eval-of-a-garbage-export", ["eval", "{garbage}", "--data", "{data}"], 1,
         ["cannot read", "garbage/model.safetensors", "damaged"]),
    Case("embed-of-a-truncated-export", ["embed", "{truncated}", "--texts", "a red circle", "--out", "{nowhere}.npy"],
         1, ["cannot read", "truncated/model.safetensors", "damaged"]),
    Case("export-of-a-garbage-export", ["export", "{garbage}", "--out", "{nowhere}"], 1,
         ["cannot read", "garbage/model.safetensors", "damaged"]),
    Case("caption-of-a-truncated-export", ["caption", "{truncated}", "--images", "{image}"], 1,
         ["cannot read", "truncated/model.safetensors", "damaged"]),
    Case("teacher-of-a-garbage-export", ["TRAIN", "model.loss.distill=1", "model.teacher.path={garbage}"], 1,
         ["cannot read", "garbage/model.safetensors", "damaged"]),
    Case("caption-with-no-readable-image", ["caption", "{run}", "--images", "{not_an_image}", "{nowhere}.png"], 1,
         ["none of the 2 images could be read"]),
    Case("eval-captions-without-references", ["eval", "{run}", "--captions", "{no_references}"], 1,
         ["none of the", "has a reference caption"]),
    Case("eval-captions-not-coco", ["eval", "{run}", "--captions", "{twice}"], 1, ["is not valid JSON"]),
    Case("hub-model-not-cached-offline", ["eval", "hf-hub:org/absent@v1", "--data", "{data}"], 1,
         ["hf-hub:org/absent@v1 is not in the cache", "models--org--absent for revision v1", "HF_HUB_OFFLINE"]),
    Case("hub-teacher-not-cached-offline", ["data", "teacher-embed", "hf-hub:org/absent", "{data}"], 1,
         ["teacher hf-hub:org/absent is not in the cache", "HF_HUB_OFFLINE"]),
    Case("from-coco-bbox-not-four-numbers", ["data", "from-coco", "--instances", "{bad_instances}", "--images",
                                             "{images}", "--out", "{nowhere}.jsonl"], 1,
         ["bad-instances.json", '"annotations"[0]', '"bbox" must be 4 numbers']),
]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> dict:
    """A 2-step tiny-coca run (it captions), its export, a garbage and a truncated copy of that, a
    Hugging Face folder of a model_type vltrain does not open, and the files the cases name."""
    shapes = session_shapes(tmp_path_factory)
    root = tmp_path_factory.mktemp("bad-inputs")
    user = root / "user"  # everything the user had: hashed around every case
    run = user / "run"
    ok(train(shapes, run, nproc=1, timeout=240, model__preset="tiny-coca", train__max_steps=STEPS,
             checkpoint__every=STEPS, data__num_workers=0))
    export = user / "export"
    ok(forkrun.run(["export", str(run), "--out", str(export)], timeout=240, cwd=root))
    weights = (export / "model.safetensors").read_bytes()
    for name, data in (("garbage", bytes(range(256)) * 8), ("truncated", weights[: len(weights) // 2])):
        shutil.copytree(export, user / name)
        (user / name / "model.safetensors").write_bytes(data)
    bert = user / "bert"  # a Hugging Face folder: config.json beside its weights
    bert.mkdir()
    shutil.copy(export / "model.safetensors", bert)
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (user / "twice.yaml").write_text("model:\n  preset: tiny-clip\ntrain:\n  lr: 1.0e-3\nmodel:\n  preset: tiny-coca\n")
    (user / "not-an-image.png").write_text("these are words, not pixels\n")
    image = next((shapes / "images").rglob("*.png"))
    (user / "bad-instances.json").write_text(json.dumps({  # COCO's instances, one bbox of 3 numbers
        "images": [{"id": 1, "file_name": image.name, "width": 32, "height": 32}],
        "annotations": [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [1, 2, 3], "iscrowd": 0}],
        "categories": [{"id": 1, "name": "shape"}]}))
    (user / "no-references.json").write_text(json.dumps(
        {"images": [{"filename": image.name, "split": "test", "sentences": []}]}))
    Image.new("L", (16, 16)).save(user / "small-mask.png")  # a mask half its image's side
    (user / "dense.jsonl").write_text(json.dumps({"image": str(image), "mask": "small-mask.png"}) + "\n")
    (user / "dense_classes.json").write_text(json.dumps(["background", "shape"]))
    paths = {"run": run, "export": export, "garbage": user / "garbage", "truncated": user / "truncated",
             "bert": bert, "twice": user / "twice.yaml", "not_an_image": user / "not-an-image.png",
             "no_references": user / "no-references.json", "image": image, "data": shapes / "train.jsonl",
             "bad_instances": user / "bad-instances.json", "images": image.parent,
             "nowhere": root / "nowhere", "dense": user / "dense.jsonl"}
    hub = root / "hub"  # a Hugging Face cache, read offline: a repository of data, no model
    (root / "dataset").mkdir()
    (root / "dataset" / "README.md").write_text("a dataset\n")
    (root / "dataset" / "train.csv").write_text("a,b\n")
    put(hub, "org/data", root / "dataset", commit_of("data"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), HF_HOME=str(root / "hf-home"))
    return {"shapes": shapes, "root": root, "user": user, "paths": paths, "env": env}


def _argv(case: Case, kit: dict, fresh: Path) -> list[str]:
    out = []
    for word in case.argv:
        if word == "TRAIN":
            out += ["train", str(kit["shapes"] / "base.yaml"), *overrides(kit["shapes"], fresh, data__num_workers=0)]
        else:
            out.append(word.format(**{k: str(v) for k, v in kit["paths"].items()}))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_gets_its_exit_code_one_line_naming_it_and_changes_nothing(case, kit):
    fresh = kit["root"] / f"fresh-{case.id}"
    before = {"user": _digest(kit["user"]), "data": _digest(kit["shapes"])}
    proc = forkrun.run(_argv(case, kit, fresh), timeout=240, cwd=kit["root"], env=kit["env"])
    said = proc.stdout + proc.stderr
    assert "Traceback" not in said, said[-3000:]
    errors = [line for line in said.splitlines() if re.search(r"\berror: ", line)]
    assert len(errors) == 1, said[-3000:]
    assert all(w in errors[0] for w in case.words), (case.words, errors[0])
    assert proc.returncode == case.code, (proc.returncode, errors[0])
    for name, root in (("user", kit["user"]), ("data", kit["shapes"])):  # new files (an index cache) may come
        after = _digest(root)
        assert {k: after.get(k) for k in before[name]} == before[name], f"a file under {root} changed"
    assert not fresh.exists() or not any(p.is_file() for p in fresh.rglob("*")), "a refused run wrote files"


def test_every_case_is_a_row_of_docs_errors_md_and_every_row_of_this_file_a_case():
    """docs/errors.md's table lists the cases by id, with the test that runs each: this file's rows and
    CASES are the same set, and a row another test runs names a test file that exists."""
    rows = [line.split("|")[1:-1] for line in DOC.read_text().splitlines() if re.match(r"\| `[a-z0-9-]+` \|", line)]
    mine = {r[0].strip().strip("`") for r in rows if "tests/cli/test_bad_inputs.py" in r[-1]}
    assert mine == {c.id for c in CASES}
    for r in rows:
        tests = re.findall(r"tests/[\w/]+\.py", r[-1])
        assert tests and all((DOC.parents[1] / t).is_file() for t in tests), r
    for c in CASES:
        (row,) = [r for r in rows if r[0].strip().strip("`") == c.id]
        assert row[2].strip() == str(c.code), (c.id, row)
