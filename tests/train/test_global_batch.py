"""data.global_batch_size: the same samples in every step and the same math whatever the split,
so a run continues its own trajectory on another number of ranks: the dual encoder (ITC, SigLIP,
distillation from a teacher), the fusion model (ITC + ITM + MLM) and the captioning model (SigLIP
+ caption), with text-only and image-only rows in the data. Real
processes (gloo), 1 and 2 ranks."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from kits.runkit import (final_state, from_checkpoint, losses, metric_rows, model_distance, ok, session_shapes, train,
                         worst)

STEPS = 20
TOL = 1e-5
G = 12
"""The global batch: the 64 rows of an epoch are not a multiple of it, so epochs end in padding."""
SPLITS = {"1 rank, A=1": (1, {}), "1 rank, A=2 (gradcache)": (1, {"data__micro_batch_size": G // 2}),
          "2 ranks, A=1": (2, {})}


def mixed(tmp_path_factory) -> Path:
    """The shapes with 20% text-only rows, and every seventh image-text row made image-only."""
    shapes = session_shapes(tmp_path_factory)
    out = shapes / "mixed.jsonl"
    if not out.exists():
        rows = [json.loads(x) for x in (shapes / "train.jsonl").read_text().splitlines()]
        for i, row in enumerate(rows):
            if i % 7 == 3 and "image" in row:
                del row["text"]
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return shapes


RESUME_AT = 8
"""The step the resume test continues from: the one checkpoint besides the last that a run here saves."""


def run(shapes: Path, run_dir: Path, nproc: int, **extra):
    settings = {"data__train": shapes / "mixed.jsonl", "data__global_batch_size": G, "data__audit": "true",
                "train__max_steps": STEPS, "train__log_every": 1, "checkpoint__every": RESUME_AT}
    if extra.get("model__teacher__path") == TEACHER:
        extra["model__teacher__path"] = teacher(shapes.parent)
    return train(shapes, run_dir, nproc=nproc, timeout=240, **{**settings, **extra})



def step_ids(run_dir: Path, accumulation: int) -> dict[tuple[int, int], list[int]]:
    """The sample ids of each optimizer step (epoch, step), from every rank's audit file."""
    out: dict[tuple[int, int], list[int]] = defaultdict(list)
    for f in (run_dir / "audit").glob("rank*.jsonl"):
        for r in map(json.loads, f.read_text().splitlines()):
            if r["kind"] == "batch":
                out[(r["epoch"], r["step"] // accumulation)] += r["ids"]
    return {k: sorted(v) for k, v in out.items()}


FUSION = {"model__preset": "tiny-albef", "model__loss__itm": 1, "model__loss__mlm": 0.5, "model__loss__text_mlm": 0.3,
          "model__vision__patch_dropout": 0.5, "model__vision__patch_dropout_until": 10}
"""ITM's groups are the global batch's default (3 of 12 rows): no key ties them to a split. Patch
dropout in steps 1 to 10, so the fusion encoder reads only kept image tokens, then every patch:
the resume below (from step 8) crosses the switch."""
UNIMODAL = {"model__loss__text_mlm": 0.3, "model__loss__image_mim": 0.3, "model__vision__patch_dropout": 0.25}
"""What text-only and image-only rows train: keyed MLM and MIM masks, means over the step; with
patch dropout on every step (MIM's own pass keeps every position). Trained with the EMA case."""
BUDGET = {"data__batching": "budget"}
"""Budget steps: 3 to 12 rows under 96 text positions and 12 images per step (the defaults)."""
EMA = {"train__ema__decay": 0.8, "train__ema__warmup": "true", "checkpoint__save_initial": "always", **UNIMODAL}
"""ITC with the weight EMA and the unimodal objectives: the averages agree on every split, and after
the resume on 1 rank."""
TEACHER = "hf-clip-teacher"
DISTILL = {"model__loss__distill": 1, "model__loss__distill_sigmoid": 0.5, "model__teacher__path": TEACHER}
"""ITC with both distillation losses from a live teacher (a Hugging Face CLIP folder of another
image size, other statistics and its own tokenizer), its embeddings gathered across ranks."""
CAPTION = {"model__preset": "tiny-coca", "model__loss__itc": 0, "model__loss__siglip": 1, "model__loss__caption": 1}
"""SigLIP with a captioning decoder (SigLIP 2's recipe starts there): next-token loss on the image-text
rows, a plain language model on the text-only rows, nothing on the image-only rows; a mean over
the step's caption tokens."""
LOSSES = {"itc": EMA, "siglip": CAPTION, "fusion": FUSION, "budget": BUDGET, "distill": DISTILL}


def teacher(root: Path) -> Path:
    """The tiny random Hugging Face CLIP teacher of the distill case, made once per session."""
    from kits.pretrainedkit import make_clip

    folder = root / TEACHER
    if not (folder / "config.json").exists():
        make_clip(folder, seed=0)
    return folder


_RUNS: dict[tuple[str, str], tuple[Path, object]] = {}


def split_run(tmp_path_factory, loss: str, name: str):
    """The run of ``LOSSES[loss]`` on split ``name``, made once per session: the split tests and
    the resume test (whose uninterrupted reference is the 2-rank run) read the same one."""
    key = (loss, name)
    if key not in _RUNS:
        nproc, extra = SPLITS[name]
        if nproc == 1:  # only the 2-rank run is resumed from: the others save their last step alone
            extra = {**extra, "checkpoint__every": 0}
        run_dir = tmp_path_factory.mktemp(f"global-batch-{loss}") / name.replace(" ", "_")
        _RUNS[key] = (run_dir, ok(run(mixed(tmp_path_factory), run_dir, nproc, **LOSSES[loss], **extra)))
    return _RUNS[key]


@pytest.fixture(scope="module", params=list(LOSSES))
def splits(request, tmp_path_factory):
    return mixed(tmp_path_factory), {name: split_run(tmp_path_factory, request.param, name) for name in SPLITS}


@pytest.mark.timeout(600)
def test_one_global_batch_split_three_ways_trains_the_same_model(splits, tmp_path):
    _, done = splits
    (ref, proc), *others = done.values()
    rows = "at most " if "batching=budget" in " ".join(proc.args) else ""
    assert f"global batch 12 = 1 rank(s) x 1 micro-batch(es) x {rows}12 rows" in proc.stderr
    assert (f"global batch 12 = 1 rank(s) x 2 micro-batch(es) x {rows}6 rows (gradcache)"
            in done["1 rank, A=2 (gradcache)"][1].stderr)
    if "tiny-albef" in str(proc.args):
        for _, split in done.values():
            assert ("ITM negatives from groups of 3 consecutive rows of the global batch (the default for a global "
                    "batch of 12: the same on any number of ranks)") in split.stderr
        assert all(set(r) >= {"loss/itm", "loss/mlm"} for r in metric_rows(ref))
    if "tiny-coca" in str(proc.args):
        assert all(set(r) >= {"loss/siglip", "loss/caption"} for r in metric_rows(ref))
    if "patch_dropout" in " ".join(proc.args):
        until = "steps 1 to 10" if "tiny-albef" in str(proc.args) else "every step"
        assert "patch dropout: each image drops" in proc.stderr and until in proc.stderr
        assert_patch_dropout_changes_the_first_step(splits[0], ref, tmp_path)
    base = losses(ref)
    assert len(base) == STEPS
    for run_dir, _ in others:
        curve = losses(run_dir)
        assert len(curve) == STEPS
        assert worst(curve, base) < TOL, (run_dir.name, curve, base)
        assert model_distance(final_state(run_dir), final_state(ref)) < TOL
        if "ema.decay" in " ".join(proc.args):
            assert model_distance(final_state(run_dir), final_state(ref), "ema.weights.") < TOL
    if "ema.decay" in " ".join(proc.args):
        assert_the_ema_moved_towards_the_weights(ref)


def assert_patch_dropout_changes_the_first_step(shapes: Path, ref: Path, tmp_path: Path) -> None:
    """The same run without patch dropout, one step: another loss (the log line alone would not
    show that any patch was dropped)."""
    loss = ref.parent.name.removeprefix("global-batch-").rstrip("0123456789")
    settings = {**LOSSES[loss], "model__vision__patch_dropout": 0, "model__vision__patch_dropout_until": 0,
                "train__max_steps": 1}
    ok(run(shapes, tmp_path / "no-dropout", 1, **settings))
    assert losses(tmp_path / "no-dropout")[0] != losses(ref)[0]


def assert_the_ema_moved_towards_the_weights(run_dir: Path) -> None:
    """The EMA left the initial weights (RUN_DIR/init.safetensors) and is nearer the trained ones
    than they are: an EMA that never updated would still be the initial weights."""
    from safetensors.torch import load_file

    state = final_state(run_dir)
    names = [k.removeprefix("ema.weights.") for k in state if k.startswith("ema.weights.")]
    init = load_file(run_dir / "init.safetensors")

    def flat(get) -> torch.Tensor:
        return torch.cat([get(name).flatten().double() for name in names])

    ema, weights = flat(lambda n: state[f"ema.weights.{n}"]), flat(lambda n: state[f"model.{n}"])
    start = flat(lambda n: init[n])
    travelled = (weights - start).norm()
    assert (ema - weights).norm() < 0.9 * travelled and (ema - start).norm() > 0.1 * travelled


@pytest.mark.timeout(600)
def test_the_audit_shows_the_same_samples_in_every_step(splits):
    _, done = splits
    accumulation = {"1 rank, A=1": 1, "1 rank, A=2 (gradcache)": 2, "2 ranks, A=1": 1}
    ids = {name: step_ids(run_dir, accumulation[name]) for name, (run_dir, _) in done.items()}
    first = ids["1 rank, A=1"]
    budget = "batching=budget" in " ".join(done["1 rank, A=1"][1].args)
    assert len(first) == STEPS and all(3 <= len(v) <= G if budget else len(v) == G for v in first.values())
    if budget:  # steps of several sizes, and the same ones on any split
        assert len({len(v) for v in first.values()}) > 1
    assert ids["1 rank, A=2 (gradcache)"] == first and ids["2 ranks, A=1"] == first


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["itc", "siglip", "fusion", "budget", "distill"])
def test_stopped_on_two_ranks_and_resumed_on_one_it_continues_the_same_trajectory(model, tmp_path_factory, tmp_path):
    shapes = mixed(tmp_path_factory)
    unstopped, _ = split_run(tmp_path_factory, model, "2 ranks, A=1")
    run_dir = from_checkpoint(unstopped, tmp_path / "run", RESUME_AT)  # as a 2-rank run stopped at step 10 leaves it
    resumed = ok(run(shapes, run_dir, 1, data__micro_batch_size=G // 2, **LOSSES[model]))
    assert f"at step {RESUME_AT} on 1 rank(s) (same global batches; model and optimizer resharded from 2)" \
        in resumed.stdout + resumed.stderr
    if model == "fusion":  # the log says what the run does: the checkpoint's groups
        assert "ITM negatives from groups of 3 consecutive rows of the global batch (the checkpoint's" in resumed.stderr
    curve, base = losses(run_dir), losses(unstopped)[RESUME_AT:]
    assert len(curve) == STEPS - RESUME_AT and worst(curve, base) < TOL
    assert model_distance(final_state(run_dir), final_state(unstopped)) < TOL
    if model == "itc":  # the EMA resharded from 2 ranks to 1 with the model
        assert model_distance(final_state(run_dir), final_state(unstopped), "ema.weights.") < TOL
    if model == "itc":  # the checkpoint's global batch against the config's: one model kind shows it
        refused = run(shapes, tmp_path / "run", 1, data__global_batch_size=G // 2, train__max_steps=STEPS + 2,
                      **LOSSES[model])
        assert refused.returncode != 0 and f"resume with data.global_batch_size={G}" in refused.stderr


def test_indivisible_splits_are_refused_naming_what_works():
    from vltrain.config.job import JobConfig
    from vltrain.errors import ConfigError
    from vltrain.compose.rules import resolve_global_batch

    cfg = JobConfig()
    cfg.data.global_batch_size = 10
    with pytest.raises(ConfigError, match="does not split among 4 ranks; use a multiple of 4 \\(e.g. 8 or 12\\)"):
        resolve_global_batch(cfg, 4)
    cfg.data.micro_batch_size = 3
    with pytest.raises(ConfigError, match=r"does not divide the 5 rows .* use one of \[1, 5\]"):
        resolve_global_batch(cfg, 2)
    cfg.data.global_batch_size, cfg.data.micro_batch_size = 12, 2
    assert resolve_global_batch(cfg, 2).startswith("global batch 12 = 2 rank(s) x 3 micro-batch(es) x 2 rows (gradcache)")
    assert (cfg.data.batch_size, cfg.train.accumulation, cfg.train.contrastive_accumulation) == (2, 3, "gradcache")
    tied = JobConfig()
    assert "tied to the world size" in resolve_global_batch(tied, 2)


def test_a_captioner_without_a_contrastive_loss_accumulates_without_gradcache():
    """Gradient caching caches the contrastive loss's gradient: with the caption loss alone (BLIP's
    captioner) there is none, so micro-batches accumulate plainly, and asking for it is refused."""
    from vltrain.config.job import load_config
    from vltrain.errors import ConfigError
    from vltrain.compose.rules import decide_objectives, resolve_global_batch

    cfg = load_config(None, ["model.preset=tiny-coca", "model.loss.itc=0", "data.global_batch_size=12",
                             "data.micro_batch_size=2"])
    assert resolve_global_batch(cfg, 2) == "global batch 12 = 2 rank(s) x 3 micro-batch(es) x 2 rows"
    assert cfg.train.contrastive_accumulation == "none"
    cfg.train.contrastive_accumulation = "gradcache"
    with pytest.raises(ConfigError, match="no contrastive objective is on"):
        decide_objectives(cfg)


def test_budget_steps_that_cannot_feed_every_micro_batch_are_refused():
    from vltrain.config.job import JobConfig
    from vltrain.errors import ConfigError, UserError
    from vltrain.compose.rules import resolve_global_batch

    cfg = JobConfig()
    cfg.data.batching, cfg.data.global_batch_size, cfg.data.micro_batch_size = "budget", 16, 2
    with pytest.raises(ConfigError, match=r"at least 4 rows .* its 8 micro-batches .* from \[4, 8, 16\]"):
        resolve_global_batch(cfg, 1)
    cfg.data.micro_batch_size, cfg.data.max_text_length, cfg.data.token_budget = 4, 32, 100
    with pytest.raises(UserError, match="data.token_budget=100 is too small .* at least 256"):
        resolve_global_batch(cfg, 2)
    cfg.data.token_budget = 0  # the step's default: 16 x 32 / 2
    said = resolve_global_batch(cfg, 2)
    assert said == ("global batch 16 = 2 rank(s) x 2 micro-batch(es) x at most 4 rows (gradcache); budget steps "
                    "of 4 to 16 rows, 256 text positions, 16 images")


def test_the_default_itm_group_depends_on_the_global_batch_alone():
    from vltrain.compose.rules import default_itm_group

    assert {g: default_itm_group(g) for g in (2, 8, 12, 16, 64, 100, 256, 1024, 4096, 32768, 13, 26)} == {
        2: 2, 8: 2, 12: 3, 16: 4, 64: 8, 100: 10, 256: 16, 1024: 32, 4096: 64, 32768: 64, 13: 13, 26: 2}


def test_a_split_the_default_itm_groups_cannot_serve_is_refused_naming_what_works():
    from vltrain.errors import ConfigError
    from vltrain.model.config import LossConfig
    from vltrain.compose.rules import itm_group

    loss = LossConfig(itm=1.0, itm_negatives="group")
    for micro in (16, 8, 4):  # 1, 2 and 4 micro-batches: groups of 4 in each
        assert itm_group(loss, micro, 16) == (4, "the default for a global batch of 16")
    with pytest.raises(ConfigError, match=r"groups of 4 rows .* micro-batches of 2 rows: split a step of 16 rows "
                                          r"into at most 4 micro-batches .* one of \[1, 2\]"):
        itm_group(loss, 2, 16)
    assert itm_group(loss, 8, 16, saved=8) == (8, "the checkpoint's")
    loss.itm_group_size = 2
    assert itm_group(loss, 2, 16) == (2, "model.loss.itm_group_size")  # the user's choice serves it
    assert itm_group(loss, 8, 16, saved=8) == (2, "model.loss.itm_group_size")  # and is kept over a checkpoint's
    assert itm_group(LossConfig(itm=1.0, itm_negatives="local"), 8, 16) == (0, "")  # no groups: nothing chosen
