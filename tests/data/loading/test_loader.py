"""The training and evaluation loaders, with real worker processes and real gloo ranks."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from kits.multiproc import run_world
from kits.sampler_fixtures import TableDataset, collate, fork_workers, open_data, shapes_lengths, synth_files, table, uid

from vltrain.data.config import DataConfig, SourceSpec
from vltrain.data.loading.audit import AuditLog, audit_run
from vltrain.data.loading.loader import TrainLoader, build_eval_loader, build_train_loader
from vltrain.data.schedule.sampler import DistributedBatchSampler, Schedule
from vltrain.errors import DataError
from vltrain.model import build_model
from vltrain.model.config import LossConfig, ModelConfig
from vltrain.objectives.scoring import Objectives
from vltrain.compose.task import Score, Task


def make_loader(t, *, rank=0, world_size=1, workers=0, run_dir=None, **kw) -> TrainLoader:
    """A loader over a table-shaped dataset (no files), for behaviour that needs no decoding."""
    kw.setdefault("batch_size", 4)
    sampler = DistributedBatchSampler(t, Schedule(seed=7, **kw), rank=rank, world_size=world_size)
    audit = AuditLog(run_dir, rank, world_size) if run_dir else None
    return TrainLoader(TableDataset(t), sampler, collate=collate, num_workers=workers,
                       persistent_workers=workers > 0, audit=audit)


def real_loader(data_cfg, *, rank=0, world_size=1, run_dir=None) -> TrainLoader:
    ds, collator = open_data(data_cfg)
    return build_train_loader(data_cfg, ds, rank=rank, world_size=world_size, seed=7, run_dir=run_dir,
                              pad_id=collator.pad_id)


# -- one epoch on 2 ranks x 2 workers, from a manifest and from shards -----------------------

N_EPOCH = 45


def _epoch_rank(rank, world_size, data_cfg, run_dir):
    fork_workers()
    loader = real_loader(data_cfg, rank=rank, world_size=world_size, run_dir=run_dir)
    return {"ids": [next(loader).ids.tolist() for _ in range(len(loader))], "padded": loader.sampler.plan().padded}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", ["manifest", "shards"])
def test_two_ranks_two_workers_consume_the_source_once(tmp_path, form):
    data_cfg, uids = synth_files(tmp_path / "data", N_EPOCH, shards=form == "shards", batch_size=4,
                                 num_workers=2, audit=True)
    got = run_world(_epoch_rank, (data_cfg, str(tmp_path / "run")), world=2, timeout=200)
    assert len(got[0]["ids"]) == len(got[1]["ids"])  # equal step counts
    flat = [i for g in got for b in g["ids"] for i in b]
    padded = got[0]["padded"]
    assert padded == 3  # 45 samples, 2 ranks x 4 rows per step: 48 rows, the first 3 repeated
    assert set(flat) == uids
    assert len(flat) == N_EPOCH + padded
    report = audit_run(tmp_path / "run")
    assert report.ok, report.problems
    assert report.complete_epochs == 1 and report.samples == N_EPOCH + padded


# -- exact resume with workers --------------------------------------------------------------


def _take(loader, k):
    return [(b.ids.tolist(), b.images.pixels.sum((1, 2, 3)).tolist()) for b in (next(loader) for _ in range(k))]


@pytest.mark.parametrize("batching", ["fixed", "budget"])
def test_state_restored_at_step_k_yields_the_same_sequence_with_workers(tmp_path, batching):
    data_cfg, _ = synth_files(tmp_path, 30, text_only_fraction=0.3, batch_size=4, num_workers=2,
                              batching=batching, token_budget=4 * 24, pad_multiple=8)
    # pad_multiple 8: rows of one padded width tie, so even this 30-row epoch forms new batches
    # each epoch (at exact lengths nearly every row's length is unique here, pairs would repeat)
    a = real_loader(data_cfg, rank=1, world_size=2)
    epoch_len = len(a)
    k, total = epoch_len + 2, 2 * epoch_len + 3  # resume in the 2nd epoch, run into the 3rd
    head = _take(a, k)
    state = json.loads(json.dumps(a.state_dict()))  # survives a round trip through a checkpoint
    tail = _take(a, total - k)
    b = real_loader(data_cfg, rank=1, world_size=2)
    b.load_state_dict(state)
    assert b.epoch == 1 and b.step_in_epoch == 2
    assert _take(b, total - k) == tail  # the same samples, decoded to the same pixels
    assert b.samples_seen == a.samples_seen
    assert head[0] != tail[0]


class _CountingDataset(TableDataset):
    """Appends one line to ``path`` per sample loaded, from whichever process loads it."""

    def __init__(self, t, path) -> None:
        super().__init__(t)
        self.path = str(path)

    def __getitem__(self, i: int):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return super().__getitem__(i)


def test_workers_prefetch_the_next_epoch_before_the_trainer_asks(tmp_path):
    """No drain at the boundary: with the epoch's last batch taken, the workers are already
    loading the next epoch's first batches, and the stream is the one a 0-worker loader gives."""
    import time

    t, log = table(shapes_lengths(16)), tmp_path / "loaded.txt"
    sampler = DistributedBatchSampler(t, Schedule(seed=7, batch_size=4), rank=0, world_size=1)
    loader = TrainLoader(_CountingDataset(t, log), sampler, collate=collate, num_workers=2, prefetch_factor=2,
                         persistent_workers=True)
    got = [next(loader).ids.tolist() for _ in range(len(loader))]  # the whole of epoch 0
    assert loader.epoch == 0
    deadline = time.monotonic() + 30
    while len(log.read_text().split()) < 16 + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(log.read_text().split()) >= 16 + 4  # epoch 1's first batch, loaded unasked
    got += [next(loader).ids.tolist() for _ in range(6)]
    assert (loader.epoch, loader.step_in_epoch) == (2, 2)
    loader.close()
    assert got == _take_ids(make_loader(t), 10)


def _take_ids(loader, n):
    return [next(loader).ids.tolist() for _ in range(n)]


def test_a_checkpoint_of_another_world_size_resumes_by_samples_seen():
    t = table(shapes_lengths(40))
    two = [make_loader(t, rank=r, world_size=2) for r in range(2)]
    taken = {i for loader in two for _ in range(3) for i in next(loader).ids.tolist()}
    one = make_loader(t)
    one.load_state_dict(two[0].state_dict())
    assert (one.epoch, one.step_in_epoch) == (0, 6)
    assert one.state_dict()["sampler"]["world_size"] == 1
    rest = {i for _ in range(len(one) - 6) for i in next(one).ids.tolist()}
    assert taken.isdisjoint(rest) and len(taken | rest) == 40


def test_closing_the_loader_closes_its_audit_file(tmp_path):
    loader = make_loader(table(shapes_lengths(8)), run_dir=tmp_path)
    next(loader)
    loader.close()
    assert loader.audit._f.closed
    assert [json.loads(x)["kind"] for x in (tmp_path / "audit" / "rank0.jsonl").read_text().splitlines()] == [
        "epoch", "batch"]


def test_per_sample_seeds_make_random_draws_independent_of_workers():
    t = table(shapes_lengths(30), has_image=np.arange(30) % 4 != 0)
    draws = [_take(make_loader(t, workers=w), 6) for w in (0, 2)]
    assert draws[0] == draws[1]


def test_a_sample_draws_the_same_numbers_on_any_number_of_ranks():
    """Per-sample seeds come from (seed, epoch, sample), not from the rank or the place in a batch:
    a global batch split among 2 ranks augments every sample as 1 rank does."""
    t = table(shapes_lengths(24))

    def pixels(loaders, steps):
        """(step, sample id) -> the sample's pixel sum, over every rank's batches."""
        return {(step, i): p for loader in loaders for step, (ids, sums) in enumerate(_take(loader, steps))
                for i, p in zip(ids, sums)}

    one = pixels([make_loader(t, batch_size=4)], 9)  # into the second epoch
    two = pixels([make_loader(t, rank=r, world_size=2, batch_size=2) for r in range(2)], 9)
    assert len(one) == 36 and one == two
    assert len(set(one.values())) > len(one) // 2  # the draws do differ between samples


def test_main_process_loading_leaves_the_trainer_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader = make_loader(table(shapes_lengths(8)))
    next(loader)
    assert torch.equal(torch.rand(3), expected)


# -- budget batching on 2 ranks -------------------------------------------------------------

def _skewed_shapes(folder):
    """Shapes data whose second half carries two captions per row: a long tail of lengths."""
    data_cfg, _ = synth_files(folder, 480, batch_size=32)
    rows = [json.loads(line) for line in open(data_cfg.train)]
    for i, r in enumerate(rows[240:]):
        r["text"] = f"{r['text']}, and {rows[i]['text']}"
    with open(data_cfg.train, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return data_cfg


def _budget_rank(rank, world_size, data_cfg):
    ds, collator = open_data(data_cfg)
    stats = {}
    for batching in ("fixed", "budget"):
        cfg = replace(data_cfg, batching=batching)  # everything else at the defaults
        loader = build_train_loader(cfg, ds, rank=rank, world_size=world_size, seed=1, run_dir=None,
                                    pad_id=collator.pad_id)
        steps = positions = real = worst = 0
        for _ in range(len(loader)):
            b = next(loader)
            x = torch.tensor([float(b.input_ids.numel())])
            dist.all_reduce(x)  # a collective per step: unequal step counts would hang here
            steps += 1
            positions += b.input_ids.numel()
            real += int(b.attention_mask.sum())
            worst = max(worst, b.input_ids.numel())
        stats[batching] = [steps, positions, real, worst, loader.sampler.token_budget]
    return stats


@pytest.mark.timeout(180)
def test_budget_batching_on_two_ranks_equal_steps_within_budget_low_padding(tmp_path):
    per_rank = run_world(_budget_rank, (_skewed_shapes(tmp_path),), world=2, timeout=150)
    ratio = {}
    for batching in ("fixed", "budget"):
        steps = {r[batching][0] for r in per_rank}
        assert len(steps) == 1, f"{batching}: ranks ran {steps} steps"
        positions, real = (sum(r[batching][i] for r in per_rank) for i in (1, 2))
        ratio[batching] = positions / real
        print(f"{batching} batching: {steps.pop()} steps, padding ratio {ratio[batching]:.3f}")
    assert all(r["budget"][3] <= r["budget"][4] for r in per_rank)  # token budget never exceeded
    assert ratio["budget"] <= 1.15
    assert ratio["budget"] < ratio["fixed"]


# -- 90% text-only rows, budget batching, 2 ranks, 100 DDP steps -----------------------------


def _text_only_rank(rank, world_size, data_cfg):
    torch.manual_seed(0)
    ds, collator = open_data(data_cfg)
    loader = build_train_loader(data_cfg, ds, rank=rank, world_size=world_size, seed=7, run_dir=None,
                                pad_id=collator.pad_id)
    model = build_model(ModelConfig(preset="tiny-clip"), vocab_size=ds.tokenizer.vocab_size, pad_id=ds.tokenizer.pad_id,
                        mask_id=ds.tokenizer.mask_id, image_size=data_cfg.image_size,
                        max_text_length=data_cfg.max_text_length)
    ddp = torch.nn.parallel.DistributedDataParallel(Task(model, Objectives(LossConfig(), model.spec)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    sizes, text_only_batches = [], 0
    for _ in range(100):
        b = next(loader)
        out = ddp(Score(b.to_model_inputs("cpu", data_cfg.mean, data_cfg.std)))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        sizes.append(len(b))
        text_only_batches += int(not b.has_image.any())
    return {"steps": len(sizes), "sizes": sizes, "text_only": text_only_batches, "epoch": loader.epoch,
            "loss": float(out.loss)}


@pytest.mark.timeout(300)
def test_ninety_percent_text_only_budget_batching_trains_100_steps_without_hang(tmp_path):
    data_cfg, _ = synth_files(tmp_path, 80, text_only_fraction=0.9, batching="budget", batch_size=8,
                              token_budget=8 * 24, image_budget=2, num_workers=0)
    got = run_world(_text_only_rank, (data_cfg,), world=2, timeout=270)
    assert [g["steps"] for g in got] == [100, 100]
    assert all(np.isfinite(g["loss"]) for g in got)
    assert got[0]["epoch"] == got[1]["epoch"] >= 1  # crossed epoch boundaries in step
    assert sum(g["text_only"] for g in got) > 0  # some steps really had text-only batches
    assert got[0]["sizes"] != got[1]["sizes"]  # ranks ran different batch sizes in the same step


# -- evaluation -----------------------------------------------------------------------------


@pytest.mark.parametrize("n,world", [(10, 3), (2, 3), (16, 2)])
def test_eval_loader_contiguous_disjoint_slices_equal_batch_counts(n, world):
    t = table(shapes_lengths(n))
    cfg = DataConfig(num_workers=0, pin_memory=False)
    loaders = [build_eval_loader(cfg, TableDataset(t, cfg.image_size), rank=r, world_size=world, batch_size=3,
                                 pad_id=0) for r in range(world)]
    assert len({len(x) for x in loaders}) == 1
    kept = []
    for x in loaders:
        rows = [i for b in x for i in b.ids.tolist()]
        kept += rows[: x.num_samples]
        assert rows[: x.num_samples] == [uid(i) for i in range(x.offset, x.offset + x.num_samples)]
    assert kept == [uid(i) for i in range(n)]


def test_build_train_loader_reads_batching_and_source_weights_from_config():
    n0, n1 = 30, 10
    t = table(shapes_lengths(n0 + n1), has_image=[True] * n0 + [False] * n1, source=[0] * n0 + [1] * n1)
    cfg = DataConfig(train=[SourceSpec("a.jsonl", 1.0), SourceSpec("b.jsonl", 3.0)], batching="budget",
                     batch_size=8, num_workers=0, pin_memory=False)
    loader = build_train_loader(cfg, TableDataset(t, cfg.image_size), rank=0, world_size=1, seed=0, run_dir=None,
                                pad_id=0)
    s = loader.sampler
    assert s.batching == "budget" and s.token_budget == 8 * 77 // 2 and s.image_budget == 8
    # weights are per-row rates: the 10 text-only rows are read 3x as often as the 30 others
    assert s.source_weights == [30.0, 30.0]
    sources = torch.cat([next(loader).source for _ in range(len(loader))])
    assert len(sources) == n0 + n1 and int((sources == 1).sum()) == 20


def test_equal_source_weights_read_every_row_once():
    t = table(shapes_lengths(25), source=[0] * 15 + [1] * 10)
    cfg = DataConfig(train=[SourceSpec("a.jsonl"), SourceSpec("b.jsonl")], batch_size=5, num_workers=0)
    loader = build_train_loader(cfg, TableDataset(t, cfg.image_size), rank=0, world_size=1, seed=0, run_dir=None,
                                pad_id=0)
    ids = [i for _ in range(len(loader)) for i in next(loader).ids.tolist()]
    assert sorted(ids) == sorted(uid(i) for i in range(25))


# -- errors from workers --------------------------------------------------------------------


def test_a_data_error_in_a_worker_reaches_the_trainer_as_its_plain_message(tmp_path):
    data_cfg, _ = synth_files(tmp_path, 6, batch_size=2, num_workers=1, on_error="fail")
    for image in (tmp_path / "images").rglob("*.png"):
        image.write_bytes(b"not an image")
    loader = real_loader(data_cfg)
    with pytest.raises(DataError) as e:
        next(loader)
    message = str(e.value)
    assert "Traceback" not in message and "worker process" not in message
    assert message.startswith("bad sample '") and "data.on_error: skip" in message
    assert type(e.value) is DataError


def test_a_data_error_in_an_eval_worker_is_plain_too(tmp_path):
    data_cfg, _ = synth_files(tmp_path, 6, num_workers=1, on_error="fail")
    for image in (tmp_path / "images").rglob("*.png"):
        image.write_bytes(b"")
    ds, collator = open_data(data_cfg)
    loader = build_eval_loader(data_cfg, ds, rank=0, world_size=1, batch_size=2, pad_id=collator.pad_id)
    with pytest.raises(DataError, match=r"^bad sample .*empty file") as e:
        list(loader)
    assert "Traceback" not in str(e.value)
