"""Models by their Hub name (``checkpoint/hub.py``): ``hf-hub:ORG/NAME[@REVISION]`` resolved in a cache
filled beforehand in huggingface_hub's layout (:mod:`kits.hubkit`), offline: nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

from kits.hubkit import commit_of, offline_hub, put  # noqa: E402,F401
from kits.pretrainedkit import TEXTS, image_file, make_blip, make_clip, make_siglip, make_siglip2  # noqa: E402
from kits.runkit import overrides, session_shapes, train_here  # noqa: E402

from vltrain.checkpoint import hub  # noqa: E402
from vltrain.checkpoint.paths import locate  # noqa: E402
from vltrain.compose.decide import decide, locate_teacher  # noqa: E402
from vltrain.compose.opening import open_model  # noqa: E402
from vltrain.config.job import load_config  # noqa: E402
from vltrain.errors import UsageError, UserError  # noqa: E402
from vltrain.export.native import embed  # noqa: E402

COCA = Path(__file__).resolve().parents[1] / "model" / "interop" / "fixtures" / "openclip-coca"
A, B = commit_of("first"), commit_of("second")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    """Two tiny CLIPModels of one architecture, different weights: the repository's two commits."""
    root = tmp_path_factory.mktemp("clips")
    for name, seed in (("first", 0), ("second", 1)):
        make_clip(root / name, seed=seed)
    return {A: root / "first", B: root / "second"}


@pytest.fixture
def clip_repo(offline_hub, clips) -> Path:
    """org/clip: tag v1 and commit A, then main at commit B."""
    put(offline_hub, "org/clip", clips[A], A, refs=("v1",))
    put(offline_hub, "org/clip", clips[B], B, refs=("main",))
    return offline_hub


def _weights(opened) -> dict[str, torch.Tensor]:
    return opened.model.state_dict()


def test_a_name_resolves_to_its_branch_tag_or_commit(clip_repo, caplog):
    caplog.set_level("INFO")
    found = locate("hf-hub:org/clip", role="model.init")
    assert found.kind == "hf-clip" and found.path == clip_repo / "models--org--clip" / "snapshots" / B
    assert found.pinned == found.name == f"hf-hub:org/clip@{B}"
    assert f"model.init hf-hub:org/clip: commit {B}" in caplog.text  # the resolution, in one line
    assert locate(f"hf-hub:org/clip@{A}").path.name == A  # a commit sha
    assert locate("hf-hub:org/clip@v1").path.name == A  # a tag
    assert locate("hf-hub:org/clip@main").pinned == f"hf-hub:org/clip@{B}"  # a branch, named
    assert locate(clip_repo / "models--org--clip" / "snapshots" / A).pinned == ""  # a folder is a folder


def test_every_imported_kind_opens_by_its_name(offline_hub, tmp_path):
    makers = {"hf-siglip": make_siglip, "hf-siglip2": make_siglip2, "hf-blip": make_blip}
    for kind, make in makers.items():
        make(tmp_path / kind)
        put(offline_hub, f"org/{kind}", tmp_path / kind, commit_of(kind))
    assert {kind: locate(f"hf-hub:org/{kind}").kind for kind in makers} == {k: k for k in makers}
    # OpenCLIP's Hub layout: open_clip_config.json and open_clip_model.safetensors; some add timm's config.json
    put(offline_hub, "org/coca", COCA, commit_of("coca"))
    timm = tmp_path / "timm"
    shutil.copytree(COCA, timm)
    (timm / "config.json").write_text(json.dumps({"architecture": "vit_base_patch16_224", "num_classes": 0}))
    put(offline_hub, "org/coca-timm", timm, commit_of("timm"))
    for repo in ("org/coca", "org/coca-timm"):
        found = locate(f"hf-hub:{repo}")
        assert found.kind == "openclip-coca" and (found.path / "open_clip_config.json").is_file()


def test_opened_by_name_is_the_commits_model_and_its_config_pins_it(clip_repo, clips):
    by_name, by_tag = open_model("hf-hub:org/clip", purpose="embed"), open_model("hf-hub:org/clip@v1")
    assert by_name.cfg.model.init == f"hf-hub:org/clip@{B}" and by_tag.cfg.model.init == f"hf-hub:org/clip@{A}"
    for opened, commit in ((by_name, B), (by_tag, A)):
        folder = _weights(open_model(clips[commit]))
        assert all(torch.equal(v, folder[k]) for k, v in _weights(opened).items())
    assert not all(torch.equal(v, _weights(by_tag)[k]) for k, v in _weights(by_name).items())


def test_a_teacher_by_name_is_pinned(clip_repo, tmp_path_factory, tmp_path):
    plan = locate_teacher("hf-hub:org/clip@v1", "teacher")  # `vltrain data teacher-embed hf-hub:...`
    assert plan.located.kind == "hf-clip" and plan.located.path.name == A
    shapes = session_shapes(tmp_path_factory)
    cfg = load_config(None, overrides(shapes, tmp_path / "run", model__teacher__path="hf-hub:org/clip",
                                      model__loss__distill=1.0, data__tokenizer="''", model__init="hf-hub:org/clip"))
    decided = decide(cfg)
    assert decided.cfg.model.teacher.path == decided.cfg.model.init == f"hf-hub:org/clip@{B}"
    assert decided.teacher.located.path.name == B


def test_a_run_from_a_name_saves_the_commit_and_resumes_on_it(clip_repo, clips, tmp_path_factory, tmp_path,
                                                               monkeypatch):
    shapes = session_shapes(tmp_path_factory)
    run = tmp_path / "run"

    def train(steps: int):
        return train_here(load_config(None, overrides(shapes, run, model__init="hf-hub:org/clip", data__tokenizer="''",
                                                      train__max_steps=steps, data__num_workers=0,
                                                      checkpoint__every=0)))

    train(2)
    assert load_config(run / "config.yaml").model.init == f"hf-hub:org/clip@{B}"
    (clip_repo / "models--org--clip" / "refs" / "main").write_text(A)  # main moves on
    assert locate("hf-hub:org/clip").path.name == A
    trainer = train(3)  # resumes from step 2: the commit its checkpoint saved, not main's
    assert trainer.step == 3 and trainer.decided.weights.path.name == B
    assert load_config(run / "config.yaml").model.init == f"hf-hub:org/clip@{B}"
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `vltrain eval RUN` needs no Hub:
    eval_cfg = open_model(run).cfg  # the run's saved, pinned config and its own weights
    assert eval_cfg.model.init == f"hf-hub:org/clip@{B}"


@pytest.mark.timeout(240)
def test_cli_embeds_and_evaluates_by_name(clip_repo, clips, tmp_path_factory, tmp_path, cli):
    shapes = session_shapes(tmp_path_factory)
    png = image_file(tmp_path / "y.png", seed=8)
    proc = cli("embed", "hf-hub:org/clip@v1", "--images", png, "--texts", *TEXTS[:2], "--out", tmp_path / "e.npy")
    assert proc.returncode == 0, proc.stderr
    opened = open_model(clips[A])
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), embed(opened.model, opened.tokenizer, opened.cfg, [png],
                                                                 TEXTS[:2]), atol=1e-5)
    proc = cli("eval", "hf-hub:org/clip", "train.threads=1", "data.num_workers=0", "--data", shapes / "val.jsonl",
               "--json")
    assert proc.returncode == 0, proc.stderr
    assert f"hf-hub:org/clip: commit {B}" in proc.stderr and "mean_recall" in json.loads(proc.stdout)


@pytest.mark.parametrize("name", ["hf-hub:", "hf-hub:foo", "hf-hub:a/b/c", "hf-hub:a/b@", "hf-hub:a b/c",
                                  "hf-hub:org/na$me", "hf-hub:org/x--y", "hf-hub:-org/name", "hf-hub:org/name@a b"])
def test_a_malformed_name_says_the_syntax(name):
    with pytest.raises(UsageError, match=r"^model.init .* is not a Hub model name: write hf-hub:ORG/NAME or "
                                         r"hf-hub:ORG/NAME@REVISION") as e:
        locate(name, role="model.init")
    assert "\n" not in str(e.value)


def test_offline_and_not_cached_names_the_repository_and_the_cache(clip_repo):
    for name, revision in (("hf-hub:org/absent", "main"), ("hf-hub:org/clip@v2", "v2")):
        with pytest.raises(UserError, match="HF_HUB_OFFLINE") as e:
            locate(name, role="model.init")
        message = str(e.value)
        assert name in message and f"revision {revision}" in message and str(clip_repo) in message
        assert "\n" not in message


def test_a_repository_of_something_else_says_what_it_holds(offline_hub, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "README.md").write_text("a dataset")
    (tmp_path / "data" / "train.csv").write_text("a,b\n")
    put(offline_hub, "org/data", tmp_path / "data", commit_of("data"))
    with pytest.raises(UsageError, match=r"holds neither a transformers model .* it holds README.md, train.csv"):
        locate("hf-hub:org/data")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    put(offline_hub, "org/bert", tmp_path / "bert", commit_of("bert"))
    with pytest.raises(UsageError, match="model_type 'bert', which vltrain does not open"):
        locate("hf-hub:org/bert")


def test_a_cached_snapshot_without_weights_says_to_fetch_them_online(offline_hub, clips, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    for file in clips[A].glob("*.json"):
        shutil.copy(file, configs / file.name)
    put(offline_hub, "org/partial", configs, A)
    with pytest.raises(UserError, match=r"holds no weights \(model.safetensors, .*\), and HF_HUB_OFFLINE is set"):
        locate("hf-hub:org/partial")


def test_without_huggingface_hub_the_message_names_the_extra(clip_repo, clips, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails, as when it is not installed
    with pytest.raises(UserError, match=r"needs the huggingface_hub package: pip install 'vltrain\[hub\]'$"):
        locate("hf-hub:org/clip", role="model.init")
    assert locate(clips[A]).kind == "hf-clip"  # a folder needs no huggingface_hub


def test_parse_reads_the_revision():
    repo = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    assert hub.parse(f"hf-hub:{repo}") == hub.HubName(repo)
    assert hub.parse("hf-hub:org/name@refs/pr/1").revision == "refs/pr/1"
    assert hub.parse(f"hf-hub:org/name@{A}").is_commit and not hub.parse("hf-hub:org/name@v1").is_commit


def test_online_it_fetches_the_configs_then_one_weights_file(offline_hub, clips, monkeypatch, tmp_path):
    """The online path with huggingface_hub's two calls stood in for (the tests have no network): a
    repository holding safetensors, PyTorch and TensorFlow copies gets its configs, then safetensors alone."""
    import fnmatch

    import huggingface_hub

    remote = tmp_path / "remote"
    shutil.copytree(clips[A], remote)
    for extra in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack"):
        (remote / extra).write_bytes(b"other copies of the weights")
    calls = []

    def snapshot_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None):
        calls.append((revision, allow_patterns, local_files_only, cache_dir))
        picked = tmp_path / f"picked-{len(list(tmp_path.glob('picked-*')))}"
        picked.mkdir()
        for file in remote.iterdir():
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                shutil.copy(file, picked / file.name)
        return str(put(Path(cache_dir), repo_id, picked, A))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda repo, revision: sorted(p.name for p in remote.iterdir()))
    found = locate("hf-hub:org/clip")
    cache = str(offline_hub)
    assert calls == [(None, ["*.json", "*.txt"], False, cache), (A, ["model.safetensors"], False, cache)]
    assert found.kind == "hf-clip" and found.pinned == f"hf-hub:org/clip@{A}"
    assert sorted(p.name for p in found.path.iterdir() if not p.name.endswith(".json")) == ["model.safetensors"]
    calls.clear()
    assert locate("hf-hub:org/clip").path == found.path and len(calls) == 1  # held: the weights are not fetched again
