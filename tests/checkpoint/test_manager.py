"""Checkpointer on small modules: round trips, atomic layout, resume settings, refusals, 2 ranks."""

from __future__ import annotations

import json
import os
import pickle
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kits.multiproc import free_port
from torch import nn

from vltrain.checkpoint.integrity import MANIFEST
from vltrain.checkpoint.manager import (
    Checkpointer,
    ModelState,
    OptimizerState,
    find_checkpoint,
    latest_checkpoint,
    load_model_weights,
)
from vltrain.checkpoint.storage import join_tensors, read_tensors, split_tensors
from vltrain.config.job import CheckpointConfig, load_config
from vltrain.errors import UserError
from vltrain.runtime.rng import RngState
from vltrain.types import freeze


class Counter:
    """A toy Stateful with the awkward types real states hold (tuples, numpy, int keys)."""

    def __init__(self):
        self.n = 0
        self.history: tuple = ()

    def state_dict(self):
        return {"n": np.int64(self.n), "history": self.history, "by_int": {1: "a"}}

    def load_state_dict(self, sd):
        assert sd["by_int"] == {1: "a"}
        self.n = int(sd["n"])
        self.history = sd["history"]


def toy_model(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(6, width), nn.LayerNorm(width), nn.Dropout(0.2), nn.Linear(width, 3))


class Job:
    """Model, optimizer, schedule and a counter, stepped with every RNG involved."""

    def __init__(self, run_dir, cfg: CheckpointConfig, width: int = 8, wrap=None, init_seed: int = 0,
                 config: list[str] | None = None):
        torch.manual_seed(init_seed)
        self.model = toy_model(width)
        self.net = wrap(self.model) if wrap else self.model
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.counter = Counter()
        states = {"model": ModelState(self.net), "optimizer": OptimizerState(self.net, self.opt),
                  "scheduler": self.sched, "counter": self.counter}
        self.ckpt = Checkpointer(cfg, run_dir, states, {"rng": RngState()}, config=freeze(load_config(None, config)))

    def step(self):
        x = torch.randn(4, 6) * (1 + random.random()) + float(np.random.rand())
        loss = self.net(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.counter.n += 1
        self.counter.history += (self.counter.n,)

    def params(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).numpy().copy()


def seed_all(s: int) -> None:
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def test_split_join_round_trip():
    tree = {"a": torch.ones(2), "t": (1, 2.5, None), "k": {3: [torch.zeros(1), "x"]},
            "np": np.arange(3, dtype=np.int32), "s": np.float32(0.5), "__tensor__": 1}
    tensors = {}
    skel = split_tensors(tree, "root", tensors)
    back = join_tensors(json.loads(json.dumps(skel)), tensors)
    assert set(tensors) == {"root.a", "root.k.3.0"}
    assert back["t"] == (1, 2.5, None) and back["k"][3][1] == "x" and back["__tensor__"] == 1
    assert back["np"].dtype == np.int32 and back["np"].tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="per-rank"):
        split_tensors({"x": torch.ones(1)}, "rng", None)
    with pytest.raises(TypeError, match="object"):
        split_tensors({"x": object()}, "bad", {})


def test_resume_is_bit_identical(tmp_path):
    cfg = CheckpointConfig(every=3, keep=2)
    seed_all(1)
    full = Job(tmp_path / "full", cfg)
    for s in range(1, 8):
        full.step()
        full.ckpt.maybe_save(s)

    seed_all(1)
    first = Job(tmp_path / "cut", cfg)
    for s in range(1, 6):  # crash after step 5: steps 4 and 5 are lost
        first.step()
        first.ckpt.maybe_save(s)
    seed_all(99)  # a fresh process: different init and RNG until the checkpoint restores them
    second = Job(tmp_path / "cut", cfg, init_seed=5)
    restored = second.ckpt.resume("auto")
    assert restored.step == 3 and restored.exact and second.counter.n == 3
    assert second.counter.history == (1, 2, 3)
    for s in range(restored.step + 1, 8):
        second.step()
        second.ckpt.maybe_save(s)
    assert np.array_equal(full.params(), second.params())
    assert second.sched.get_last_lr() == full.sched.get_last_lr()


def test_layout_latest_keep_and_partial(tmp_path):
    job = Job(tmp_path, CheckpointConfig(every=1, keep=2))
    for s in range(1, 5):
        job.step()
        job.ckpt.maybe_save(s, final=s == 4)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-3", "step-4"]
    assert (folder / "latest").read_text().strip() == "step-4"
    assert {"state.json", "rank-0.json", "config.yaml", ".metadata"} <= {p.name for p in (folder / "step-4").iterdir()}
    assert not job.ckpt.maybe_save(4, final=True)  # the end of a run at a saved step writes nothing twice

    # a crash mid-save leaves a temporary folder; a hand-made step folder without state is not complete
    (folder / ".tmp-step-5").mkdir()
    (folder / ".tmp-step-5" / "__0_0.distcp").write_bytes(b"half")
    (folder / "step-9").mkdir()
    (folder / "latest").write_text("step-9\n")
    assert latest_checkpoint(folder).name == "step-4"
    Job(tmp_path, CheckpointConfig(every=1, keep=2)).ckpt.resume("auto")
    assert not (folder / ".tmp-step-5").exists()


def test_resumed_from_an_older_checkpoint_latest_follows_the_new_line(tmp_path):
    job = Job(tmp_path, CheckpointConfig(every=1, keep=3))
    for s in range(1, 6):
        job.step()
        job.ckpt.maybe_save(s)
    folder = tmp_path / "checkpoints"
    again = Job(tmp_path, CheckpointConfig(every=1, keep=1))
    assert again.ckpt.resume(str(folder / "step-3")).step == 3
    again.step()
    again.ckpt.maybe_save(4)  # writes over the abandoned step-4; step-5 is newer but not its line
    assert latest_checkpoint(folder).name == "step-4"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-4", "step-5"]


def test_resume_settings(tmp_path):
    job = Job(tmp_path / "run", CheckpointConfig())
    assert job.ckpt.resume("auto") is None
    assert job.ckpt.resume("never") is None
    job.step()
    job.ckpt.maybe_save(1, final=True)
    assert job.ckpt.resolve("never") is None
    assert job.ckpt.resolve("auto").name == "step-1"
    assert job.ckpt.resolve(str(tmp_path / "run")).name == "step-1"
    assert job.ckpt.resolve(str(tmp_path / "run" / "checkpoints" / "step-1")).name == "step-1"
    assert find_checkpoint(tmp_path / "run" / "checkpoints").name == "step-1"
    with pytest.raises(UserError, match="does not exist"):
        job.ckpt.resume(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="no complete checkpoint"):
        job.ckpt.resume(str(tmp_path))


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    job = Job(tmp_path / "a", CheckpointConfig())
    job.step()
    job.ckpt.maybe_save(1, final=True)
    wider = Job(tmp_path / "b", CheckpointConfig(), width=16)
    before = wider.params()
    with pytest.raises(UserError) as e:
        wider.ckpt.resume(str(tmp_path / "a"))
    msg = str(e.value)
    assert "'model.0.weight'" in msg and "[8, 6]" in msg and "[16, 6]" in msg
    assert np.array_equal(before, wider.params())  # nothing was touched


def test_a_checkpoint_that_does_not_fit_names_the_settings_behind_it(tmp_path):
    """Another head or width comes from a setting: the line names it, with both values."""
    saved = ["model.embed_dim=8", "model.loss.itm=1.0", "train.lr=0.1"]
    job = Job(tmp_path / "a", CheckpointConfig(), config=saved)
    job.step()
    job.ckpt.maybe_save(1, final=True)
    here = ["model.embed_dim=16", "model.loss.itm=1.0", "train.lr=0.2"]
    with pytest.raises(UserError) as e:
        Job(tmp_path / "b", CheckpointConfig(), width=16, config=here).ckpt.resume(str(tmp_path / "a"))
    msg = str(e.value)
    assert "'model.0.weight' has shape [8, 6] there but [16, 6] here" in msg
    assert "its config differs from this run's in model.embed_dim (8 there, 16 here): resume with the " \
           "checkpoint's settings" in msg
    assert "train.lr" not in msg and "another model preset" not in msg and "\n" not in msg


def test_refuses_code_in_the_index(tmp_path):
    job = Job(tmp_path, CheckpointConfig())
    job.step()
    job.ckpt.maybe_save(1, final=True)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    step = tmp_path / "checkpoints" / "step-1"
    (step / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UserError, match=r"step-1 is damaged \(.metadata is"):  # its manifest sees the change
        Job(tmp_path, CheckpointConfig()).ckpt.resume("auto")
    (step / "files.json").unlink()  # one written without a manifest (or with it rewritten): the reader refuses
    with pytest.raises(UserError, match="not allowed"):
        Job(tmp_path, CheckpointConfig()).ckpt.resume("auto")
    assert not marker.exists()


def test_async_save_snapshots_the_state(tmp_path):
    job = Job(tmp_path, CheckpointConfig(async_save=True))
    job.step()
    job.ckpt.save(1)
    saved = job.params()
    with torch.no_grad():
        for p in job.model.parameters():
            p.add_(1.0)  # training goes on while the write is in flight
    job.ckpt.wait()
    fresh = toy_model()
    load_model_weights(find_checkpoint(tmp_path), fresh)
    assert np.array_equal(saved, torch.cat([p.detach().reshape(-1) for p in fresh.parameters()]).numpy())
    weights = read_tensors(find_checkpoint(tmp_path), "model.")
    assert torch.equal(weights["model.0.weight"], fresh[0].weight)
    assert set(weights) == {f"model.{k}" for k in fresh.state_dict()}
    # the sums are made where the save is committed, over the files the background writer wrote
    listed = json.loads((find_checkpoint(tmp_path) / MANIFEST).read_text())["files"]
    assert {"__0_0.distcp", ".metadata", "state.json", "rank-0.json"} <= set(listed)


def test_the_last_step_commits_an_async_save_of_itself_still_in_flight(tmp_path):
    # the last step is also a periodic one: its save is already written when the run's final
    # save comes, which must still wait for it and commit it
    job = Job(tmp_path, CheckpointConfig(every=2, async_save=True))
    for step in range(1, 5):
        job.step()
        job.ckpt.maybe_save(step, final=step == 4)
    assert find_checkpoint(tmp_path).name == "step-4"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]


def test_timed_saves_come_once_the_minutes_have_passed_since_the_last_save(tmp_path):
    job = Job(tmp_path, CheckpointConfig(every_minutes=0.005))  # 0.3 s
    saved = []
    for step in range(1, 6):
        job.step()
        if step in (2, 4):
            time.sleep(0.35)
        if job.ckpt.maybe_save(step, due=job.ckpt.due()):
            saved.append(step)
    assert saved == [2, 4]
    off = Job(tmp_path / "off", CheckpointConfig())
    time.sleep(0.05)
    assert not off.ckpt.due()


# ---------------------------------------------------------------------------------------------
# Two ranks, gloo


def _run_phase(rank: int, root: str, phase: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if phase == "fsdp":
        from torch.distributed.fsdp import fully_shard as wrap
    else:
        wrap = DDP
    cfg = CheckpointConfig(every=2, keep=3, async_save=phase == "async")
    job = Job(f"{root}/{'cut' if phase == 'resume' else phase}", cfg, wrap=wrap, init_seed=0)
    seed_all(10 + rank)  # each rank its own stream (dropout, inputs)
    start = 0
    if phase == "resume":
        seed_all(1000 + rank)
        restored = job.ckpt.resume("auto")
        assert restored.step == 4 and restored.exact
        start = restored.step
    for s in range(start + 1, 8):
        job.step()
        job.ckpt.maybe_save(s, final=s == 7)
        if phase == "cut" and s == 5:
            return
    params = [p.full_tensor() if phase == "fsdp" else p for p in job.model.parameters()]  # collective
    if rank == 0:
        np.save(f"{root}/{phase}.npy", torch.cat([p.detach().reshape(-1) for p in params]).numpy())


def _two_rank_worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for phase in ("full", "cut", "resume", "fsdp", "async"):
            _run_phase(rank, root, phase)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_ddp_resume_reshard_and_fsdp(tmp_path):
    mp.start_processes(_two_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    assert np.array_equal(np.load(tmp_path / "full.npy"), np.load(tmp_path / "resume.npy"))
    ckpt = tmp_path / "full" / "checkpoints" / "step-7"
    rngs = [json.loads((ckpt / f"rank-{r}.json").read_text())["rng"]["torch"] for r in (0, 1)]
    assert rngs[0] != rngs[1]  # each rank's own generators

    # one process loads the 2-rank checkpoint: model and optimizer reshard, per-rank state does not apply
    job = Job(tmp_path / "full", CheckpointConfig())
    restored = job.ckpt.resume("auto")
    assert restored.step == 7 and restored.world_size == 2 and not restored.exact
    assert np.array_equal(job.params(), np.load(tmp_path / "full.npy"))
    assert job.opt.state[job.opt.param_groups[0]["params"][0]]["step"].item() == 7

    # the background writer (its own gloo group) wrote the same as the blocking one
    assert np.array_equal(np.load(tmp_path / "async.npy"), np.load(tmp_path / "full.npy"))
    saved = read_tensors(find_checkpoint(tmp_path / "async"), "model.")
    flat = torch.cat([saved[f"model.{name}"].reshape(-1) for name, _ in toy_model().named_parameters()])
    assert np.array_equal(flat.numpy(), np.load(tmp_path / "async.npy"))
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir()) == [
        "latest", "step-4", "step-6", "step-7"]

    # FSDP2 shards are consolidated into a plain model
    model = toy_model()
    load_model_weights(find_checkpoint(tmp_path / "fsdp"), model)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert np.array_equal(got, np.load(tmp_path / "fsdp.npy"))
