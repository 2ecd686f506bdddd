"""The Trainer: one class whose set-up reads in order and whose loop reads straight through.

Set-up: distributed -> model -> parallelize -> optimizer -> scheduler -> data -> checkpointer
-> metrics; every attribute is assigned in ``__init__``. Everything that a resumed run must restore
is Stateful (``state_dict`` / ``load_state_dict``) and listed by :meth:`Trainer.stateful`, so a
checkpointer only collects. What one step does is in :mod:`vltrain.train.step`; the loop here feeds
it, logs, evaluates and checkpoints.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch

from vltrain.checkpoint.manager import (
    INITIAL_FILE,
    Checkpointer,
    ModelState,
    OptimizerState,
    Restored,
    write_whole_once,
)
from vltrain.checkpoint.paths import latest_checkpoint
from vltrain.checkpoint.space import QuietWrites, check_writable
from vltrain.compose.builders import build_task, build_train_loader_for
from vltrain.compose.decide import Decided, decide, describe_preprocessing
from vltrain.compose.opening import open_model
from vltrain.compose.rules import describe_itm
from vltrain.config.job import JobConfig
from vltrain.config.stages import stretches
from vltrain.data.batch import Batch
from vltrain.data.dataset import source_specs
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.eval.evaluator import Evaluator, append_eval, check_early_stop_metric, format_metrics
from vltrain.model import VLModel
from vltrain.runtime import allocator
from vltrain.runtime.distributed import all_gather_object, host_sums, release_mesh
from vltrain.runtime.faults import maybe_fail
from vltrain.runtime.precision import Precision
from vltrain.runtime.preemption import EXIT_CODE as PREEMPTED_EXIT
from vltrain.runtime.preemption import INTERRUPTED_EXIT_CODE as INTERRUPTED_EXIT
from vltrain.runtime.preemption import Preempted, PreemptionWatch, clear_marker, write_marker
from vltrain.runtime.rng import seeded
from vltrain.runtime.spmd import RECORDER
from vltrain.runtime.world import setup_world
from vltrain.train.adapters import adapt
from vltrain.train.ema import WeightAverage
from vltrain.train.metrics import (GpuUtilization, MetricsLogger, Throughput, memory_bytes, peak_flops,
                                   peak_memory_bytes, plot_curves, restart_cost)
from vltrain.train.nonfinite import NonFiniteGuard
from vltrain.train.optim import build_optimizer, build_scheduler, freeze_towers
from vltrain.train.parallelize import parallelize
from vltrain.train.staging import Stages, switch_loader
from vltrain.train.source_metrics import SourceMeter
from vltrain.train.step import Step, StepResult
from vltrain.train.teacher import Teacher, describe as describe_teacher, stored_inputs

log = logging.getLogger(__name__)

class Trainer:
    def __init__(self, cfg: JobConfig):
        tc = cfg.train
        self.run_dir = Path(cfg.run.dir)

        # distributed: process group, device, threads
        self.world = setup_world(timeout_s=tc.timeout_s, device=tc.device, threads=tc.threads, tf32=tc.tf32,
                                 debug_spmd=tc.debug_spmd, deterministic=tc.deterministic)
        self.device = self.world.device
        # the config decided once, a frozen copy of the one given: what config.yaml says is what the run uses
        self.decided: Decided = decide(cfg, self.world.world_size, "train")
        self.cfg = cfg = self.decided.cfg
        tc, self.itm_source = cfg.train, self.decided.itm_source
        self._prepare_run_dir()

        self.tokenizer, self.model, self.precision = self._build_model()  # the same weights on every rank

        # the objectives, and the parallelized task; the stages (train.stages: stage 0 is the config as given)
        self.objectives = (task := build_task(cfg, self.model)).objectives
        self.wrapped, self.stages = parallelize(task, tc, self.device), Stages(cfg)
        self.teacher, self.teacher_inputs = self._build_teacher()  # distillation's, if any; replicated or sharded

        # optimizer, scheduler, gradient scaler, the weight EMA; the step that uses and calls them; the guard
        self.optimizer = build_optimizer(self.model, tc)
        self.scheduler = build_scheduler(self.optimizer, tc, stretches(self.stages.all))
        self.scaler, self.ema = self.precision.grad_scaler(), WeightAverage(tc.ema, self.model) if tc.ema.decay else None
        self.stepper = self._build_step()
        self.guard = NonFiniteGuard(tc.max_nonfinite_steps)
        self.preemption, self.preempt_agreed, self.save_due = PreemptionWatch(), False, False

        # each rank's generators (the objectives' draws are keyed by step and sample instead)
        self.rng = seeded(tc.seed + 1 + self.world.rank)
        self.sources = source_specs(cfg.data.train)
        names = self.stages.objective_names(self.model.spec)  # every objective some stage trains
        self.source_meter = SourceMeter([s.display_name() for s in self.sources], names, self.device)
        self.loader = build_train_loader_for(cfg, self.tokenizer, self.world, self.run_dir, self.teacher_inputs)
        self.loader.elastic = bool(cfg.data.global_batch_size)
        self.global_batch = cfg.data.batch_size * tc.accumulation * self.world.world_size
        self.evaluator = Evaluator(cfg, self.tokenizer, self.world, self.run_dir)

        # counters (Stateful through this object); the samples of the steps since the last settle, on the device
        self.step, self.samples_seen, self.bad_samples, self.samples_pending = 0, 0, 0, None
        self.best_metric, self.evals_without_improvement = None, 0
        self.regions_dropped = [0, 0]  # regions cut away by a crop, and past data.max_regions: every rank's

        # throughput: measuring the CPU's peak draws random numbers, so it comes before the resume
        self.throughput = Throughput(peak_flops(self.device, dtype := self.precision.dtype), self.device.type != "cuda", dtype)
        self.gpu_util = GpuUtilization(self.device)

        # checkpointer: collects self.stateful(); resumes last of all, so that the generators it
        # restores are exactly those the next step draws from
        files = {"tokenizer.json": self.tokenizer.path} if self.tokenizer.path else None
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, self.stateful(), {"rng": self.rng},
                                         config=cfg, files=files, drop=tuple(tc.resume_drop))
        self.restored, cost = self._resume()
        self._write_run_files()  # only now: a run refused by any check above has written nothing

        self.metrics = MetricsLogger(self.run_dir, enabled=self.world.is_main, total_steps=tc.max_steps,
                                     progress=tc.progress, start_step=self.step, wandb=cfg.metrics, config=cfg.to_dict())
        if self.restored is not None:
            self._say_resumed(cost)

    def _resume(self) -> tuple[Restored | None, str]:
        """Restore the checkpoint ``train.resume`` names, if any; it, and what the restart cost, read
        from ``metrics.jsonl`` before the metrics logger drops the records past the checkpoint."""
        restored = self.checkpointer.resume(self.cfg.train.resume, before_load=lambda step: self.stages.fit(
            step - 1, self.wrapped, self.stepper, self.ema, self.optimizer))  # its last step's image size
        said = describe_itm(self.objectives, bool(self.cfg.data.global_batch_size), self.itm_source)
        if said and self.world.is_main:  # what ITM does, the checkpoint's group size included
            log.info(said)
        vision = self.cfg.model.vision
        if vision.patch_dropout and self.world.is_main:
            until = f"steps 1 to {vision.patch_dropout_until}" if vision.patch_dropout_until else "every step"
            log.info(f"patch dropout: each image drops {vision.patch_dropout:g} of its patches in {until}, "
                     "drawn per sample and step")
        if restored is None or not self.world.is_main:
            return restored, ""
        return restored, restart_cost(self.run_dir / "metrics.jsonl", self.step)

    def _build_model(self) -> tuple[Tokenizer, VLModel, Precision]:
        """The tokenizer, the model with the same initial weights on every rank (kept by rank 0 when
        ``checkpoint.save_initial`` asks), and the precision it trains in."""
        tc = self.cfg.train
        precision = Precision(tc.precision, self.device)
        torch.manual_seed(tc.seed)
        with precision.weights_dtype():  # fresh weights, filled from model.init if the run has one
            opened = open_model(self.decided, device=self.device)
            tokenizer, model = opened.tokenizer, opened.model
            freeze_towers(model, tc.freeze, tc.unlock_last)
            self._save_initial(model)
            if tc.lora.enabled:  # only the adapters train
                adapt(model, self.cfg, self.run_dir, self.world.is_main)
        return tokenizer, model, precision

    def _build_teacher(self):
        """The distillation teacher (``model.teacher``), opened and sharded like the student, and what
        the loader makes for it; or, with stored embeddings, no teacher and a function that finds them
        beside the training sources' indexes. (None, None) without a teacher."""
        plan = self.decided.teacher
        if plan is None:
            return None, None
        if self.world.is_main:
            log.info(describe_teacher(plan, self.cfg))
        if plan.precomputed:
            return None, lambda sources: stored_inputs(plan, sources)
        mesh = getattr(self.wrapped, "device_mesh", None)
        teacher = Teacher(plan, self.device, self.precision.autocast, mesh)
        if mesh is not None and self.world.is_main:
            log.info("teacher: sharded by FSDP2 over the student's device mesh")
        return teacher, teacher.inputs(self.cfg)

    def _build_step(self) -> Step:
        """The step, given what it updates and the parts it calls: the teacher and the weight EMA."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return Step(self.wrapped, self.objectives, params, self.optimizer, self.scheduler, self.scaler, self.precision,
                    self.cfg.train, self.world, teacher=self.teacher,
                    ema=self.ema if self.stages.current.teacher else None)

    def _say_resumed(self, cost: str) -> None:
        """One line on each restart: the checkpoint and step, the world size before and after, and
        what it cost (``restart_cost``)."""
        cost = f"; {cost}" if cost else ""
        if self.loader.elastic and self.restored.world_size != self.world.world_size:
            self.metrics.write(f"resumed from {self.restored.path} at step {self.step} on {self.world.world_size} "
                               f"rank(s) (same global batches; model and optimizer resharded from "
                               f"{self.restored.world_size}){cost}")
            return
        how = "exactly" if self.restored.exact else (
            f"from world size {self.restored.world_size}: model and optimizer resharded, data continues "
            "by samples seen (not bit-exact)")
        self.metrics.write(f"resumed from {self.restored.path} at step {self.step} ({how}){cost}")

    def _save_initial(self, model: VLModel) -> None:
        """Rank 0 keeps the weights the run starts from (``checkpoint.save_initial``), before
        parallelize shards them: ``vltrain export --interpolate`` blends them with the trained ones."""
        when = self.cfg.checkpoint.save_initial
        if self.world.is_main and (when == "always" or (when == "auto" and self.decided.weights is not None)):
            write_whole_once(self.run_dir / INITIAL_FILE, model)

    def _say_init(self) -> None:
        """What ``model.init`` gave the run (rank 0): a vltrain run, checkpoint or export its model
        section, tokenizer and weights; another checkpoint its architecture and preprocessing."""
        if self.decided.imported is not None:
            print(describe_preprocessing(self.cfg, self.decided.imported), flush=True)
        elif self.decided.weights is not None:
            print(f"model.init {self.decided.weights.weights}: saved by vltrain (its model section, tokenizer "
                  "and weights; a new optimizer and schedule)", flush=True)

    def _prepare_run_dir(self) -> None:
        """Rank 0: the run folder; what model.init gave and the global batch, said."""
        check_writable(self.run_dir)  # on every rank: each stops with the message, none waits
        if self.world.is_main:
            self._say_init()
            log.info(self.decided.batch)
            if self.device.type == "cpu":
                log.info(allocator.describe())
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def _write_run_files(self) -> None:
        """Rank 0, once every check has passed (the model, the teacher, the resume): the run's
        config.yaml (the decided config), and no marker of an earlier preemption."""
        if self.world.is_main:
            self.cfg.save(self.run_dir / "config.yaml")
            clear_marker(self.run_dir)

    # ------------------------------------------------------------------------------------------
    # Stateful

    def stateful(self) -> dict[str, Any]:
        """What a checkpoint holds that is the same on every rank (tensors may be FSDP2 shards).

        The model and the optimizer by parameter FQN, so a checkpoint outlives a change of
        wrapping or world size. The RNG generators differ per rank: they are given separately.
        """
        return {
            "model": ModelState(self.model, trainable_only=self.cfg.train.lora.enabled),
            "optimizer": OptimizerState(self.model, self.optimizer),
            **({"ema": self.ema} if self.ema is not None else {}),
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "loader": self.loader,
            "trainer": self,
        }

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "best_metric": self.best_metric,
            "evals_without_improvement": self.evals_without_improvement,
            "guard": self.guard.state_dict(),
            "global_batch": self.global_batch,
            "itm_group_size": self.objectives.itm_group_size if self.objectives.itm_negatives == "group" else 0,
            "regions_dropped": self.regions_dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("global_batch", self.global_batch)
        if self.loader.elastic and saved != self.global_batch:
            raise UserError(f"cannot resume the same run: the checkpoint's global batch is {saved} samples, this "
                            f"run's is {self.global_batch} (data.global_batch_size); resume with "
                            f"data.global_batch_size={saved}")
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.best_metric = state["best_metric"]
        self.evals_without_improvement = int(state["evals_without_improvement"])
        self.guard.load_state_dict(state["guard"])
        self.regions_dropped = list(state.get("regions_dropped", [0, 0]))  # absent from older checkpoints

    # ------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> dict[str, float]:
        """Train to ``train.max_steps`` (or an early stop); returns the last eval metrics."""
        tc = self.cfg.train
        last_eval: dict[str, float] = {}
        evaluated_at = -1
        while self.step < tc.max_steps:
            self._enter_stage()
            micro, wait = self._next_micro_batches()
            RECORDER.begin(f"in step {self.step + 1}")
            result = self.train_step(micro)
            RECORDER.end(self.device)
            self.step += 1
            self._stop_on_bad_samples()
            self.throughput.add(0, wait, self._flops(micro, self.step - 1))
            self.metrics.advance()
            if self.step % tc.log_every == 0 or self.step == tc.max_steps:
                self._log(result)
            if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.evaluator:
                last_eval, evaluated_at = self.run_eval(), self.step
                if self._should_stop(last_eval):
                    self.metrics.write(f"early stop at step {self.step}: {self.cfg.eval.early_stop_metric} "
                                       f"did not improve for {self.evals_without_improvement} evaluations")
                    break
            maybe_fail("step", self.step, self.world.rank)
            self._checkpoint(final=False)
            if self.preempt_agreed:
                self._stop_preempted()
        if self.evaluator and evaluated_at != self.step:
            last_eval = self.run_eval()
        self._checkpoint(final=True)
        self.bad_samples = self.loader.bad_log.num_bad
        return last_eval

    def _enter_stage(self) -> None:  # before each step (vltrain.train.staging.Stages.before_step)
        data = self.stages.current.data
        said = self.stages.before_step(self.step, self.wrapped, self.stepper, self.ema, self.optimizer)
        self.objectives = self.stepper.objectives
        if self.stages.current.data != data:  # the stage's images: its loaders, at the same data position
            cfg = self.stages.with_data(self.stages.current)
            self.loader = self.checkpointer.states["loader"] = switch_loader(self.loader, lambda: build_train_loader_for(
                cfg, self.tokenizer, self.world, self.run_dir, self.teacher_inputs))
            self.evaluator = Evaluator(cfg, self.tokenizer, self.world, self.run_dir)
        if said:
            self.metrics.write(said)

    def _next_micro_batches(self) -> tuple[list[Batch], float]:
        start, micro = time.perf_counter(), [next(self.loader) for _ in range(self.cfg.train.accumulation)]
        return micro, time.perf_counter() - start

    def train_step(self, micro: list[Batch]) -> StepResult:
        """One step over the micro-batches (:class:`vltrain.train.step.Step`: the teacher's pass, the
        keys and draws, forward and backward, the ranks' agreement, the update or its skip, the weight
        EMA), then what the loop keeps of it.

        Nothing in a step waits for the device (``tests/train/test_host_sync.py``): the samples and
        the skip stay there, and the host reads them in :meth:`settle`.
        """
        data = self.cfg.data
        loss_weights = [s.loss_weight for s in self.sources]
        inputs = [b.to_model_inputs(self.device, data.mean, data.std, data.modality_weights, loss_weights,
                                    self.loader.teacher, self.precision.pixel_dtype)
                  for b in micro]
        result = self.stepper(inputs, self.step)
        agreed = result.agreed
        self.guard.record_on_device(agreed.skip)
        pending = self.samples_pending
        self.samples_pending = agreed.samples if pending is None else pending + agreed.samples
        self._meter_sources(inputs, result.rows, ~agreed.skip)
        # the preemption flag, a timed save's clock, the bad samples the loader replaced and the regions
        # it dropped live on the host: agreed over host memory, every step, in one exchange
        preempt, due, bad, tried, cut, capped = host_sums(
            self.preemption.requested, self.checkpointer.due(), *self.loader.bad_log.take(),
            sum(b.num_regions_cut for b in micro), sum(b.num_regions_capped for b in micro))
        self.preempt_agreed, self.save_due = preempt > 0, due > 0
        self.loader.bad_log.add(bad, tried)
        self.regions_dropped = [self.regions_dropped[0] + cut, self.regions_dropped[1] + capped]
        return result

    def settle(self) -> int:
        """Bring the steps' device-side counts to the host (a log step, a checkpoint): samples seen,
        skipped steps (the guard may stop the run here). Returns the steps skipped since the last."""
        if self.samples_pending is not None:
            samples = int(self.samples_pending)
            self.samples_pending = None
            self.samples_seen += samples
            self.throughput.add(samples, 0.0)
        return self.guard.settle(self.step)

    def _flops(self, micro: list[Batch], step: int) -> float:
        """Model FLOPs of this rank's forward + backward in step ``step`` (0-based): the patches its
        images keep under patch dropout, each caption at its batch's width (``flops_per_sample``
        counts both passes)."""
        kept = self.objectives.kept_patch_count(step)
        return float(sum(len(b) * self.model.flops_per_sample(b.input_ids.shape[1], kept) for b in micro))

    def _meter_sources(self, inputs: list, rows: list, applied: torch.Tensor) -> None:
        """Count each source's samples, and (if the step was applied: a device bool) its per-row losses."""
        for m in inputs:
            self.source_meter.count(m.source)
        for source, row_losses in rows:
            self.source_meter.add(source, row_losses, applied)

    def _stop_on_bad_samples(self) -> None:
        """Stop past ``data.max_bad_fraction``, judged on every rank's samples together (agreed in
        :meth:`train_step`): every rank stops after the same step with the same message. Only then
        do the ranks exchange their last failure, so that the message names the same one."""
        log = self.loader.bad_log
        if not log.too_many():
            return
        last = next((x for x in all_gather_object(log.last) if x is not None), None)
        raise log.error(self.step, last)

    def _log(self, result: StepResult) -> None:
        skipped = self.settle()
        values: dict[str, Any] = {
            "loss": float(result.agreed.loss),
            **{f"loss/{k}": float(v) for k, v in result.agreed.losses.items()},
            "lr": result.lr,
            "grad_norm": float(result.grad_norm),
            "skipped": skipped > 0,  # a step since the last log line (log_every 1: this step)
            "skipped_total": self.guard.total,
            "samples_seen": self.samples_seen,
            "data/bad_samples": self.loader.bad_log.num_bad,
            "data/regions_cut": self.regions_dropped[0],
            "data/regions_capped": self.regions_dropped[1],
            **self.throughput.read(),
            **self.source_meter.read(),
            "memory_gb": memory_bytes(self.device) / 2**30,
            "peak_memory_gb": peak_memory_bytes(self.device) / 2**30,
        }
        # FSDP2 leaves the 0-dim temperature replicated: a plain tensor on every rank
        values["logit_scale"] = float(self.model.logit_scale.detach().exp())
        util = self.gpu_util.read()
        if util is not None:
            values["gpu_util"] = util
        if skipped:
            self.metrics.write(f"by step {self.step}: {skipped} step(s) skipped since the last log line, for a "
                               f"non-finite loss or gradient norm on some rank ({self.guard.in_a_row} in a row now, "
                               f"{self.guard.total} in all)")
        self.metrics.log(self.step, values)
        self.throughput.reset()

    # ------------------------------------------------------------------------------------------
    # Evaluation, early stopping, checkpoints, the end

    def run_eval(self) -> dict[str, float]:
        """Every rank embeds its shard of every set and computes the same metrics; rank 0 writes
        eval.json and logs them (data.val's as eval/KEY, the sets' as zeroshot/NAME/KEY ...)."""
        start = time.perf_counter()
        RECORDER.begin(f"in the evaluation after step {self.step}")
        metrics = self.evaluator.run(self.wrapped, self.model, self.device, self.precision.autocast)
        if self.ema is not None and self.stages.current.teacher:  # the averaged weights on the same sets, as ema/KEY
            with self.ema.applied():
                averaged = self.evaluator.run(self.wrapped, self.model, self.device, self.precision.autocast)
            counts = ("num_pairs", "num_images")
            metrics.update({f"ema/{k}": v for k, v in averaged.items() if not k.endswith(counts)})
        RECORDER.end(self.device)
        if self.world.is_main:
            append_eval(self.run_dir, self.step, metrics)
            self.metrics.log(self.step, {(k if "/" in k else f"eval/{k}"): v for k, v in metrics.items()})
            self.metrics.write(f"eval step {self.step}: {format_metrics(metrics)} "
                               f"({time.perf_counter() - start:.1f}s)")
        self.throughput.reset()  # evaluation time is not training throughput
        return metrics

    def _should_stop(self, metrics: dict[str, float]) -> bool:
        ec = self.cfg.eval
        if not ec.early_stop_metric or not ec.early_stop_patience:
            return False
        check_early_stop_metric(ec.early_stop_metric, metrics)
        value = metrics[ec.early_stop_metric]
        better = self.best_metric is None or (
            value > self.best_metric if ec.early_stop_mode == "max" else value < self.best_metric
        )
        if better:
            self.best_metric, self.evals_without_improvement = value, 0
        else:
            self.evals_without_improvement += 1
        return self.evals_without_improvement >= ec.early_stop_patience

    def _checkpoint(self, final: bool) -> None:  # the one place where state is saved (the last step always)
        self.checkpointer.maybe_save(self.step, final=final, due=self.save_due)

    def _stop_preempted(self) -> None:
        """A rank got SIGTERM/SIGUSR1/SIGINT: every rank saves this step, then the run stops (exit 75, or
        130 after Ctrl-C, which leaves no requeue marker)."""
        name = signal.Signals(self.preemption.signum).name if self.preemption.signum else "a signal on another rank"
        self.checkpointer.maybe_save(self.step, final=True)
        path = latest_checkpoint(self.checkpointer.folder)
        interrupted = self.preemption.interrupted
        if self.world.is_main and not interrupted:
            write_marker(self.run_dir, self.step, path)
        code = INTERRUPTED_EXIT if interrupted else PREEMPTED_EXIT
        raise Preempted(f"{name} at step {self.step}: checkpoint {path} written; run the same "
                        f"command again to resume (exit code {code})", exit_code=code)

    HOLD_GROUPS = ("wrapped", "model", "teacher", "objectives", "stepper", "optimizer", "ema", "scheduler", "scaler",
                   "checkpointer", "evaluator")
    """What holds a process group: DDP, FSDP2's modules and shards, the optimizer, async saves."""

    def close(self, clean: bool = True) -> None:
        """Flush the sinks, leave the process group (``clean``: after a run that did not fail),
        draw curves.png (``metrics.curves``).

        A distributed run lets go of the model, the optimizer and the checkpointer first, so that
        leaving frees the groups and joins their threads (``World.close``): the counters, the
        loader's reports and the run folder stay for the caller."""
        self.preemption.close()
        self.loader.close()
        quiet = QuietWrites()  # a full disk is said once and does not mask the error that stopped the run
        quiet.run("metrics", self.metrics.close)
        if clean and self.world.world_size > 1:
            release_mesh(getattr(self.wrapped, "device_mesh", None))
            for name in self.HOLD_GROUPS:
                setattr(self, name, None)
        self.world.close(clean)
        if self.world.is_main and self.cfg.metrics.curves:
            quiet.run("curves.png", lambda: plot_curves(self.run_dir))
