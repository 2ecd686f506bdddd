"""Every combination of objective mix, batching, parallelism and accumulation on two real ranks.

The data is mostly unpaired (about 40% text-only, 15% image-only) with micro-batches of 4, so ranks
often hold different modalities and pad their captions to different widths in the same step.
``train.debug_spmd`` is on: a divergence in vltrain's own collectives stops a run with a message
naming it. A run passes when it ends on both ranks with finite losses. The runs of the first
objective save their last step (under every batching, parallelism and accumulation); the others
leave the save out, which takes most of a 4-step run and holds nothing an objective changes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from kits.multiproc import run_world
from kits.spmd_fixtures import config, make_mixed_shapes, modality_counts, run_trainer

STEPS = 4

OBJECTIVES = {
    "itc": ["model.preset=tiny-clip"],
    "siglip": ["model.preset=tiny-clip", "model.loss.itc=0", "model.loss.siglip=1"],
    "itc+itm": ["model.preset=tiny-albef", "model.loss.itm=0.5", "model.loss.itm_negatives=global"],
    "itc+itm+mlm": ["model.preset=tiny-albef", "model.loss.itm=0.5", "model.loss.mlm=0.5",
                    "model.loss.itm_negatives=global"],
    "itc+text_mlm+image_mim": ["model.preset=tiny-clip", "model.loss.text_mlm=0.5", "model.loss.image_mim=0.5"],
    "itc+caption": ["model.preset=tiny-coca", "model.loss.caption=1"],
}
BATCHING = {"fixed": ["data.batching=fixed"], "budget": ["data.batching=budget"]}
PARALLELISM = {"ddp": ["train.parallelism=ddp"], "fsdp": ["train.parallelism=fsdp"]}
ACCUMULATION = {"1": ["train.accumulation=1"],
                "2-gradcache": ["train.accumulation=2", "train.contrastive_accumulation=gradcache"]}
FACTORS = (OBJECTIVES, BATCHING, PARALLELISM, ACCUMULATION)
COMBINATIONS = list(itertools.product(*FACTORS))  # all 48


def _matrix_worker(rank: int, world: int, root: str, run_dir: str):
    out = {}
    for combo in COMBINATIONS:
        name = "_".join(combo)
        overrides = [o for factor, level in zip(FACTORS, combo) for o in factor[level]]
        cfg = config(Path(root), Path(run_dir) / name, overrides + [f"train.max_steps={STEPS}"])
        out[name] = run_trainer(cfg, save=combo[0] == next(iter(OBJECTIVES)))
    return out


def test_every_combination_runs_on_two_ranks_whose_batches_differ(tmp_path):
    root = make_mixed_shapes(tmp_path / "shapes")
    counts = modality_counts(root)
    assert counts["text_only"] >= 0.4 * counts["rows"] and counts["image_only"] >= 0.1 * counts["rows"]

    results = run_world(_matrix_worker, (str(root), str(tmp_path)), timeout=900)
    differed = []
    for name in results[0]:
        r0, r1 = results[0][name], results[1][name]
        assert r0["steps"] == r1["steps"] == STEPS, name
        assert len(r0["losses"]) == STEPS and r0["finite"], (name, r0["losses"])
        differed += [name] if any(a != b for a, b in zip(r0["widths"], r1["widths"])) else []
    # the point of the matrix: ranks padded their captions to different widths, under each mix
    for objective in OBJECTIVES:
        assert any(n.startswith(objective + "_") for n in differed), (objective, differed)
