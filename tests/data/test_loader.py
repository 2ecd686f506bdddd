"""The training and evaluation loaders, with real worker processes and real gloo ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sampler_fixtures import TableDataset, collate, run_ranks, shapes_lengths, table, uid
from vltrain.data.audit import AuditLog, audit_run
from vltrain.data.budget import batch_tokens, padded_width
from vltrain.data.config import DataConfig, SourceSpec
from vltrain.data.loader import TrainLoader, build_eval_loader, build_train_loader
from vltrain.data.sampler import DistributedBatchSampler


def make_loader(t, *, rank=0, world_size=1, workers=0, run_dir=None, **kw) -> TrainLoader:
    kw.setdefault("batch_size", 4)
    sampler = DistributedBatchSampler(t, rank=rank, world_size=world_size, seed=7, **kw)
    audit = AuditLog(run_dir, rank, world_size) if run_dir else None
    return TrainLoader(TableDataset(t), sampler, collate=collate, num_workers=workers,
                       persistent_workers=workers > 0, audit=audit)


# -- one epoch on 2 ranks x 2 workers -------------------------------------------------------


N_EPOCH = 45


def _epoch_rank(rank, world_size, out):
    loader = make_loader(table(shapes_lengths(N_EPOCH)), rank=rank, world_size=world_size, workers=2,
                         run_dir=out)
    ids = [next(loader).ids.tolist() for _ in range(len(loader))]
    with open(f"{out}/ids{rank}.json", "w") as f:
        json.dump({"ids": ids, "padded": loader.sampler.plan().padded}, f)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_two_workers_consume_the_source_once(tmp_path):
    run_ranks(_epoch_rank, 2, str(tmp_path), timeout=150)
    got = [json.loads((tmp_path / f"ids{r}.json").read_text()) for r in range(2)]
    assert len(got[0]["ids"]) == len(got[1]["ids"])  # equal step counts
    flat = [i for g in got for b in g["ids"] for i in b]
    padded = got[0]["padded"]
    assert padded == 3  # 45 samples, 2 ranks x 4 rows per step: 48 rows, the first 3 repeated
    assert set(flat) == {uid(i) for i in range(N_EPOCH)}
    assert len(flat) == N_EPOCH + padded
    report = audit_run(tmp_path)
    assert report.ok, report.problems
    assert report.complete_epochs == 1 and report.samples == N_EPOCH + padded


# -- exact resume with workers --------------------------------------------------------------


def _take(loader, k):
    return [(b.ids.tolist(), b.pixel_values[:, 0, 0, 0].tolist()) for b in (next(loader) for _ in range(k))]


@pytest.mark.parametrize("batching", ["fixed", "budget"])
def test_state_restored_at_step_k_yields_the_same_sequence_with_workers(batching):
    t = table(shapes_lengths(30), has_image=np.arange(30) % 4 != 0)
    kw = dict(rank=1, world_size=2, workers=2, batching=batching, token_budget=4 * 24)
    a = make_loader(t, **kw)
    epoch_len = len(a)
    k, total = epoch_len + 2, 2 * epoch_len + 3  # resume in the 2nd epoch, run into the 3rd
    head = _take(a, k)
    state = json.loads(json.dumps(a.state_dict()))  # survives a round trip through a checkpoint
    tail = _take(a, total - k)
    b = make_loader(t, **kw)
    b.load_state_dict(state)
    assert b.epoch == 1 and b.step_in_epoch == 2
    assert _take(b, total - k) == tail  # same ids and the same per-sample random draws
    assert b.samples_seen == a.samples_seen
    assert head[0] != tail[0]


def test_main_process_loading_leaves_the_trainer_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader = make_loader(table(shapes_lengths(8)))
    next(loader)
    assert torch.equal(torch.rand(3), expected)


# -- budget batching on 2 ranks -------------------------------------------------------------

BUDGET = 32 * 48


def _budget_rank(rank, world_size, out):
    lens = shapes_lengths(1200)
    lens[600:] += 16  # the second half of the data has much longer captions
    t = table(lens)
    stats = {}
    for batching in ("fixed", "budget"):
        s = DistributedBatchSampler(t, batch_size=32, rank=rank, world_size=world_size, seed=1,
                                    shuffle=False, batching=batching, token_budget=BUDGET)
        steps = positions = longest = real = worst = 0
        for batch in s:
            tokens = batch_tokens(lens[batch])
            x = torch.tensor([float(tokens)])
            dist.all_reduce(x)  # a collective per step: unequal step counts would hang here
            steps += 1
            positions += tokens
            longest += len(batch) * int(lens[batch].max())
            real += int(lens[batch].sum())
            worst = max(worst, tokens)
        stats[batching] = [steps, positions, longest, real, worst]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        with open(f"{out}/budget.json", "w") as f:
            json.dump(gathered, f)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_budget_batching_on_two_ranks_equal_steps_within_budget_low_padding(tmp_path):
    run_ranks(_budget_rank, 2, str(tmp_path), timeout=150)
    per_rank = json.loads((tmp_path / "budget.json").read_text())
    lens = shapes_lengths(1200)
    lens[600:] += 16
    floor = sum(padded_width(int(x)) for x in lens) / lens.sum()  # rounding each row to 8 alone
    for batching in ("fixed", "budget"):
        steps = {r[batching][0] for r in per_rank}
        assert len(steps) == 1, f"{batching}: ranks ran {steps} steps"
        positions, longest, real = (sum(r[batching][i] for r in per_rank) for i in (1, 2, 3))
        print(f"{batching}: {steps.pop()} steps, padding ratio {positions / real:.3f} "
              f"(to the longest row {longest / real:.3f}; rounding floor {floor:.3f})")
    b = [r["budget"] for r in per_rank]
    assert max(r[4] for r in b) <= BUDGET
    positions, longest, real = (sum(r[i] for r in b) for i in (1, 2, 3))
    assert longest / real <= 1.15
    assert positions / real <= floor + 0.03  # the multiple-of-8 rounding is all that is left


# -- 90% text-only rows, budget batching, 2 ranks, 100 DDP steps -----------------------------


class TinyDualEncoder(torch.nn.Module):
    """Runs both towers on every row of every batch: rows without an image feed zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.image = torch.nn.Linear(3 * 4 * 4, 8)
        self.text = torch.nn.EmbeddingBag(64, 8, mode="sum")

    def forward(self, batch):
        img = self.image(batch.pixel_values.float().flatten(1) / 255.0)
        txt = self.text(batch.input_ids, per_sample_weights=batch.attention_mask.float())
        pair = batch.has_image & batch.has_text
        logits = img @ txt.T
        target = torch.arange(len(img))
        per_row = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        # Rows without a pair weigh 0 yet keep every parameter in the graph on every rank.
        return (per_row * pair).sum() / pair.sum().clamp(min=1) + 1e-3 * txt.pow(2).mean()


def _text_only_rank(rank, world_size, out):
    torch.manual_seed(0)
    n = 400
    rng = np.random.default_rng(0)
    has_image = rng.random(n) < 0.1
    t = table(shapes_lengths(n), has_image=has_image)
    loader = make_loader(t, rank=rank, world_size=world_size, batching="budget", batch_size=16,
                         token_budget=16 * 24, image_budget=4)
    model = torch.nn.parallel.DistributedDataParallel(TinyDualEncoder())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes, text_only_batches = [], 0
    for _ in range(100):
        batch = next(loader)
        loss = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sizes.append(len(batch))
        text_only_batches += int(not batch.has_image.any())
    with open(f"{out}/steps{rank}.json", "w") as f:
        json.dump({"steps": len(sizes), "sizes": sizes, "text_only": text_only_batches,
                   "epoch": loader.epoch, "loss": float(loss)}, f)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ninety_percent_text_only_budget_batching_trains_100_steps_without_hang(tmp_path):
    run_ranks(_text_only_rank, 2, str(tmp_path), timeout=150)
    got = [json.loads((tmp_path / f"steps{r}.json").read_text()) for r in range(2)]
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
    loaders = [build_eval_loader(cfg, TableDataset(t), rank=r, world_size=world, batch_size=3, collate=collate)
               for r in range(world)]
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
    loader = build_train_loader(cfg, TableDataset(t), rank=0, world_size=1, seed=0, run_dir=None, collate=collate)
    s = loader.sampler
    assert s.batching == "budget" and s.token_budget == 8 * 77 // 2 and s.image_budget == 8
    # weights are per-row rates: the 10 text-only rows are read 3x as often as the 30 others
    assert s.source_weights == [30.0, 30.0]
    sources = torch.cat([next(loader).source for _ in range(len(loader))])
    assert len(sources) == n0 + n1 and int((sources == 1).sum()) == 20


def test_equal_source_weights_read_every_row_once():
    t = table(shapes_lengths(25), source=[0] * 15 + [1] * 10)
    cfg = DataConfig(train=[SourceSpec("a.jsonl"), SourceSpec("b.jsonl")], batch_size=5, num_workers=0)
    loader = build_train_loader(cfg, TableDataset(t), rank=0, world_size=1, seed=0, run_dir=None, collate=collate)
    ids = [i for _ in range(len(loader)) for i in next(loader).ids.tolist()]
    assert sorted(ids) == sorted(uid(i) for i in range(25))
