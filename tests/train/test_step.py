"""The step's parts in their order (``docs/architecture.md``, "One step"): the teacher's pass feeds
the same step's objectives, and the weight EMA averages the weights the update left."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from kits.modelkit import make_batch, small_model, small_task

from vltrain.config.job import EmaSettings, load_config
from vltrain.model.config import LossConfig
from vltrain.objectives.scoring import Objectives
from vltrain.runtime.distributed import World
from vltrain.runtime.precision import Precision
from vltrain.train.ema import WeightAverage
from vltrain.train.optim import build_optimizer, build_scheduler
from vltrain.train.step import Step
from vltrain.compose.task import Score, Task
from vltrain.types import ModelInputs, TeacherEmbeds

CPU = torch.device("cpu")


class RecordingTeacher:
    """A teacher of fixed random embeddings (width 5, not the student's), recording what it embeds."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def embed(self, inputs: ModelInputs) -> TeacherEmbeds:
        self.seen.append(inputs.ids)
        g = torch.Generator().manual_seed(int(inputs.ids[0]))
        n = len(inputs)
        image, text = (F.normalize(torch.randn(n, 5, generator=g), dim=-1) for _ in range(2))
        return TeacherEmbeds(image, text, torch.tensor(20.0))


def step_of(task, teacher=None, ema=None) -> Step:
    train = load_config(None, ["train.lr=0.01", "train.warmup_steps=0"]).train
    params = [p for p in task.parameters() if p.requires_grad]
    optimizer = build_optimizer(task.model, train)
    precision = Precision("fp32", CPU)
    return Step(task, task.objectives, params, optimizer, build_scheduler(optimizer, train), precision.grad_scaler(),
                precision, train, World(0, 1, 0, CPU), teacher=teacher, ema=ema)


def test_the_teachers_pass_feeds_the_objectives_of_the_same_step():
    model = small_model()  # the teacher is given to the step, not named in a config
    task = Task(model, Objectives(LossConfig(itc=1.0, distill=1.0), model.spec))
    micro = [make_batch(4, seed=1, ids=[0, 1, 2, 3]), make_batch(4, seed=2, ids=[4, 5, 6, 7])]
    teacher = RecordingTeacher()
    with torch.no_grad():  # the loss before the update, on the teacher's embeddings of each micro-batch
        taught = [replace(m, teacher=RecordingTeacher().embed(m)) for m in micro]
        expected = sum(task(Score(m)).losses["distill"] for m in taught) / 2
    result = step_of(task, teacher=teacher)(micro, 0)
    assert [ids.tolist() for ids in teacher.seen] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(result.agreed.losses["distill"], expected)


def test_the_average_holds_the_weights_the_update_left():
    task = small_task(itc=1.0)
    ema = WeightAverage(EmaSettings(decay=0.75), task.model)
    before = [w.clone() for w in ema.weights]
    result = step_of(task, ema=ema)([make_batch(4, seed=3)], 0)
    assert not bool(result.agreed.skip) and ema.updates == 1
    moved = False
    for w, b, p in zip(ema.weights, before, ema.params):
        torch.testing.assert_close(w, 0.75 * b + 0.25 * p.detach(), rtol=0, atol=1e-6)
        moved = moved or not torch.equal(p.detach(), b)
    assert moved  # the update changed the weights, so an average of the old ones would differ
