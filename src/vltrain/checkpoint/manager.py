"""Checkpoints: atomic, resharding, and exact to the bit on resume.

Layout under ``RUN_DIR/checkpoints`` (``checkpoint.folder``)::

    step-40/            one complete checkpoint
      .metadata         DCP index of the tensors (model, optimizer state)
      __0_0.distcp ...  tensor data, written by every rank in parallel
      state.json        everything else: step, scheduler, sampler, the non-tensor part of the
                        optimizer state (param groups), with placeholders where tensors were
      rank-0.json ...   per-rank state: RNG generators, anything that differs between ranks
      config.yaml       the resolved job config, so export and eval need nothing else
    latest              the name of the newest complete checkpoint ("step-40")
    .tmp-step-50/       a checkpoint being written (or left by a crash: ignored, removed)

Tensors go through ``torch.distributed.checkpoint`` (DCP), so DDP's replicated and FSDP2's
sharded parameters are written once, in parallel, and read back into any world size. Everything
that is not a tensor goes to JSON, and loading a checkpoint never runs code from it
(``vltrain.checkpoint.storage``).

A checkpoint is written into a temporary folder; after every rank has finished, rank 0 renames it
into place and then rewrites ``latest`` with an atomic replace. A crash at any moment leaves
either the previous checkpoint or the new one complete, never a half one that looks whole.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from vltrain.checkpoint.integrity import write_manifest
from vltrain.checkpoint.paths import (
    CONFIG_FILE,
    LATEST_FILE,
    STATE_FILE,
    complete_checkpoints,
    find_checkpoint,
    latest_checkpoint,
    step_of,
)
from vltrain.checkpoint.space import disk_full, no_space, space_warning
from vltrain.checkpoint.storage import (
    PART_SUFFIX,
    SafeFileSystemReader,
    join_tensors,
    load_tensors,
    rename_durably,
    split_tensors,
    tensor_keys,
    write_atomic,
    write_weights,
)
from vltrain.config.job import CheckpointConfig, JobConfig
from vltrain.errors import UserError
from vltrain.runtime.distributed import all_gather_object, barrier, broadcast_object, is_initialized, world_info
from vltrain.runtime.faults import maybe_fail

INITIAL_FILE = "init.safetensors"
"""RUN_DIR's copy of the weights the run started from (``checkpoint.save_initial``)."""
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """The model's parameters and buffers by plain FQN, unwrapped from DDP/FSDP2/compile.

    Under FSDP2 the values are DTensor shards, which DCP writes and reshards without gathering.
    ``trainable_only`` (LoRA): the parameters that train, and the buffers (the frozen base is written
    once, :data:`~vltrain.checkpoint.paths.LORA_BASE_FILE`); loading checks them as the saving named them.
    """

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False):
        self.model = model
        self.options = StateDictOptions(ignore_frozen_params=trainable_only)
        self.load_options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=self.load_options)


class OptimizerState:
    """The optimizer keyed by parameter FQN (not by position), so it survives re-wrapping."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


@dataclass
class Restored:
    """What :meth:`Checkpointer.load` put back."""

    path: Path
    step: int
    world_size: int
    """World size of the run that wrote the checkpoint."""
    exact: bool
    """Per-rank states (RNG, per-rank data position) were restored: same world size, bit-exact."""


FIT_HINT = "was it written with another model preset, embed_dim, data.image_size or tokenizer?"


def check_shapes(source: str, saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> None:
    """Refuse weights that do not fit, naming the first key that differs and both shapes."""
    for key, shape in wanted.items():
        if key not in saved:
            raise UserError(f"{source} has no tensor {key!r} that this model needs ({FIT_HINT})")
        if tuple(saved[key]) != tuple(shape):
            raise UserError(f"{source} does not fit this model: {key!r} has shape {list(saved[key])} there "
                            f"but {list(shape)} here ({FIT_HINT})")
    for key in saved:
        if key not in wanted:
            raise UserError(f"{source} holds {key!r}, which this model does not have ({FIT_HINT})")


def _check_fits(path: Path, metadata: dcp_metadata.Metadata, targets: dict[str, torch.Tensor],
                saved_keys: list[str]) -> None:
    index = metadata.state_dict_metadata
    saved = {k: tuple(index[k].size) for k in saved_keys if hasattr(index.get(k), "size")}
    check_shapes(f"checkpoint {path}", saved, {k: tuple(t.shape) for k, t in targets.items()})


def _read_fitting(path: Path, targets: dict[str, torch.Tensor], saved_keys: list[str], no_dist: bool,
                  process_group: Any = None) -> None:
    """Check shapes, then load ``targets`` in place from the checkpoint at ``path``."""
    reader = SafeFileSystemReader(path)
    _check_fits(path, reader.read_metadata(), targets, saved_keys)
    load_tensors(reader, targets, no_dist=no_dist, process_group=process_group)


# ---------------------------------------------------------------------------------------------
# Model weights (the folders are read by vltrain.checkpoint.paths)


def load_model_weights(ckpt: Path, model: torch.nn.Module, ema: bool = False, trainable_only: bool = False) -> None:
    """Load only the model's tensors, in one process, into a plain (unwrapped) model; ``ema``: then
    its trainable parameters' EMA (``train.ema``) over them. ``trainable_only``: a LoRA checkpoint's
    adapters (and buffers), its base already loaded.

    DCP reassembles the full tensors from whatever sharding wrote them, so this also consolidates
    FSDP2 checkpoints (for export and evaluation).
    """
    state = json.loads((ckpt / STATE_FILE).read_text())
    if "model" not in state["states"]:
        raise UserError(f"checkpoint {ckpt} holds no model state")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad} if trainable_only else set()
    targets = {f"model.{k}": v for k, v in model.state_dict().items() if k not in frozen}
    _read_fitting(ckpt, targets, tensor_keys(state["states"]["model"]), no_dist=True)
    if not ema:
        return
    if "ema" not in state["states"]:
        raise UserError(f"checkpoint {ckpt} holds no EMA weights: its run trained without train.ema "
                        "(drop --ema to use its trained weights)")
    saved = tensor_keys(state["states"]["ema"])
    params = {f"ema.weights.{n}": p.detach() for n, p in model.named_parameters()}
    _read_fitting(ckpt, {k: params[k] for k in saved if k in params}, saved, no_dist=True)


def write_whole_once(path: Path, model: torch.nn.Module) -> None:
    """``model``'s whole state at ``path`` (safetensors), unless a file is there already: the weights a
    run started from (``INITIAL_FILE``, a LoRA run's base), which its resumes leave as the first start
    wrote them. Called on one rank, before any sharding, while the model is whole."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_weights(path, model.state_dict(), {"format": "pt"})


def left_behind(path: Path, names: list[str]) -> str:
    """The line for a resume that would leave ``names`` of the checkpoint's states behind."""
    held = {"ema": "its EMA weights (train.ema): resume with the run's train.ema settings to keep them"}
    why = "; ".join(held.get(name, f"its {name} state") for name in names)
    return (f"checkpoint {path} holds state this run would leave behind: {why}. Nothing was changed; to "
            f"go on without it, resume with train.resume_drop=[{','.join(names)}]")


SHAPING = ("model.", "data.image_size", "data.max_text_length", "data.tokenizer")
"""The settings that decide the model's tensors (the teacher is not saved in checkpoints)."""


def settings_apart(path: Path, config_yaml: str) -> str:
    """For a checkpoint that does not fit: the settings that decide the model's tensors in which its
    config and this run's differ, or "" when none is known."""
    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(tree, dict):
            return {prefix[:-1]: tree}
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}

    try:
        there, here = flat(yaml.safe_load((path / CONFIG_FILE).read_text())), flat(yaml.safe_load(config_yaml))
    except (OSError, yaml.YAMLError):
        return ""
    keys = [k for k in dict.fromkeys([*there, *here]) if k.startswith(SHAPING) and not k.startswith("model.teacher.")
            and there.get(k) != here.get(k)]
    if not keys:
        return ""
    apart = ", ".join(f"{k} ({there.get(k, 'unset')} there, {here.get(k, 'unset')} here)" for k in keys[:4])
    return (f"its config differs from this run's in {apart}{' and more' if len(keys) > 4 else ''}: resume "
            "with the checkpoint's settings, or give another run.dir to start a new run")


# ---------------------------------------------------------------------------------------------
# The checkpointer


def resume_target(resume: str, folder: Path) -> Path | None:
    """The checkpoint ``train.resume`` names: auto (the newest complete one in ``folder``, if any),
    never (None) or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(folder)
    return find_checkpoint(resume)


class Checkpointer:
    """Saves and restores a run's states; every rank calls every method (they hold collectives).

    ``states`` are global: tensors in them may be sharded (DCP writes each shard once); their other
    values must be the same on every rank, and rank 0's are saved. ``rank_states`` differ per rank
    (the RNG generators, a per-rank data position) and are saved by each rank to its own JSON file;
    they are restored only when the world size is unchanged. Put the RNG state last in
    ``rank_states``: it is restored last, after everything that consumes randomness.
    ``config`` (the decided one, saved by :meth:`JobConfig.save`) and ``files`` (name -> source, e.g.
    the tokenizer) are copied into every checkpoint, so that one checkpoint folder is enough to
    rebuild the model.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, states: dict[str, Stateful],
                 rank_states: dict[str, Stateful] | None = None, config: JobConfig | None = None,
                 files: dict[str, str | Path] | None = None, drop: tuple[str, ...] = ()):
        self.cfg = cfg
        self.drop = drop
        """States a resumed checkpoint may hold that ``states`` lack (``train.resume_drop``)."""
        self.folder = Path(run_dir) / cfg.folder
        self.states = states
        self.rank_states = rank_states or {}
        self.config = config
        self.files = {name: Path(src) for name, src in (files or {}).items()}
        self.rank, self.world_size = world_info()
        self._last_saved: int | None = None
        self._pending: tuple[Future, int, Path, dict[str, Any]] | None = None
        self._last_save = time.monotonic()
        """When the last save started, or the run did (``checkpoint.every_minutes``)."""
        self._writers: list[threading.Thread] = []
        """The threads DCP's async writer started: joined once the save is committed, since they
        hold the group until they end (``vltrain.runtime.distributed.group_threads``)."""
        # DCP's async writer runs collectives from a thread: it needs a group of its own
        self._async_group = dist.new_group(backend="gloo") if cfg.async_save and is_initialized() else None

    # -- saving ------------------------------------------------------------------------------

    def should_save(self, step: int, final: bool = False, due: bool = False) -> bool:
        if step == self._last_saved:
            return False
        return final or due or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def due(self) -> bool:
        """Whether ``checkpoint.every_minutes`` have passed since the last save on this rank's
        clock (the trainer agrees on it with the other ranks before it saves)."""
        minutes = self.cfg.every_minutes
        return minutes > 0 and time.monotonic() - self._last_save >= 60 * minutes

    def maybe_save(self, step: int, *, final: bool = False, due: bool = False) -> bool:
        """Save if ``step`` is a multiple of ``checkpoint.every``, the run's last, or ``due`` (time
        for a timed save, agreed by the ranks); True if it did. The run's last (``final``) also
        commits an asynchronous save of this step still in flight."""
        saved = self.should_save(step, final, due)
        if saved:
            self.save(step)
        if final:
            self.wait()
        return saved

    def save(self, step: int) -> None:
        """Write ``step-N``; with ``async_save`` it is committed by the next save or :meth:`wait`.
        A write that fails for lack of space raises ``DiskFull`` (``space.py``)."""
        self.wait()
        self._last_save = time.monotonic()
        if self.rank == 0:
            warning = space_warning(self.folder, complete_checkpoints(self.folder), self.cfg.keep)
            if warning:
                print(f"vltrain: warning: {warning}", file=sys.stderr, flush=True)
        try:
            self._save(step)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed(step, e)

    def _save(self, step: int) -> None:
        tmp = self.folder / f"{TMP_PREFIX}step-{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        tensors: dict[str, torch.Tensor] = {}
        skeletons = {name: split_tensors(st.state_dict(), name, tensors) for name, st in self.states.items()}
        per_rank = {name: split_tensors(st.state_dict(), name, None) for name, st in self.rank_states.items()}
        write_atomic(tmp / f"rank-{self.rank}.json", json.dumps(per_rank))
        self._last_saved = step
        if self._async_group is not None or (self.cfg.async_save and not is_initialized()):
            before = set(threading.enumerate())
            future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(tmp),
                                    process_group=self._async_group, no_dist=not is_initialized())
            self._writers = [t for t in threading.enumerate() if t not in before]
            self._pending = (future, step, tmp, skeletons)
            return
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not is_initialized())
        self._commit(step, tmp, skeletons)

    def wait(self) -> None:
        """Finish and commit an asynchronous save still being written."""
        if self._pending is None:
            return
        future, step, tmp, skeletons = self._pending
        self._pending = None
        try:
            future.result()
            for thread in self._writers:  # each ends once its save is done
                thread.join()
            self._writers = []
            self._commit(step, tmp, skeletons)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed(step, e)

    def _failed(self, step: int, e: BaseException) -> None:
        """A save that failed for lack of space: its partial folder removed, one clear stop."""
        cause = no_space(e)
        if cause is None:
            raise e
        if self.rank == 0:
            shutil.rmtree(self.folder / f"{TMP_PREFIX}step-{step}", ignore_errors=True)
        raise disk_full(step, self.folder, latest_checkpoint(self.folder), cause) from e

    def _commit(self, step: int, tmp: Path, skeletons: dict[str, Any]) -> None:
        maybe_fail("save", step, self.rank)
        if self.rank == 0:
            state = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size, "states": skeletons}
            write_atomic(tmp / STATE_FILE, json.dumps(state))
            if self.config is not None:
                self.config.save(tmp / CONFIG_FILE)
            for name, src in self.files.items():
                shutil.copyfile(src, tmp / name)
        self._barrier()  # every rank's data and rank file is on disk
        if self.rank == 0:
            write_manifest(tmp)
            final = self.folder / f"step-{step}"
            if final.exists():  # a run restarted with resume=never writes over its old steps
                shutil.rmtree(final)
            rename_durably(tmp, final)
            write_atomic(self.folder / LATEST_FILE, final.name + "\n")
            self._prune(final)
        self._barrier()

    def _prune(self, current: Path) -> None:
        """Keep the newest ``keep`` and always ``current`` (a run resumed from an older checkpoint
        of its own folder writes below steps it abandoned; ``latest`` names its own line)."""
        if self.cfg.keep <= 0:
            return
        for old in complete_checkpoints(self.folder)[:-self.cfg.keep]:
            if old != current:
                shutil.rmtree(old, ignore_errors=True)

    def _remove_partial(self) -> None:
        """Temporary folders are what a crash in the middle of a save leaves; none is being written now."""
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if p.name.startswith(TMP_PREFIX) or p.name.endswith(PART_SUFFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def _barrier(self) -> None:
        barrier()

    # -- loading -----------------------------------------------------------------------------

    def resolve(self, resume: str) -> Path | None:
        """``train.resume``: auto (the newest complete checkpoint, if any) | never | a path."""
        return resume_target(resume, self.folder)

    def resume(self, resume: str, before_load: Callable[[int], None] | None = None) -> Restored | None:
        """Resolve on rank 0 (so every rank loads the same one), call ``before_load`` with its step, load;
        None if nothing to resume. Then, the run accepted, a crashed save's temporary folders go."""
        chosen: list[Any] = [None]
        if self.rank == 0:
            try:
                path = self.resolve(resume)
                chosen[0] = str(path) if path is not None else None
            except UserError as e:
                chosen[0] = e
        chosen = [broadcast_object(chosen[0])]
        if isinstance(chosen[0], UserError):
            raise chosen[0]
        step = step_of(Path(chosen[0])) if chosen[0] is not None else None
        if before_load is not None and step is not None:
            before_load(step)
        restored = self.load(Path(chosen[0])) if chosen[0] is not None else None
        if self.rank == 0:
            self._remove_partial()
        return restored

    def load(self, path: Path) -> Restored:
        """Put every state back from ``path``. Shapes are checked before anything is modified.

        Each rank first reads the JSON files it needs; the ranks then agree (one exchange) before
        the collective tensor load, so a file only one rank cannot read stops every rank with that
        rank's message instead of leaving the others waiting in the load.
        """
        self.wait()
        state, rank_file, problem = None, None, None
        try:
            state, rank_file = self._read_json(path)
        except UserError as e:
            problem = str(e)
        problems = all_gather_object(problem)
        bad = next((r for r, p in enumerate(problems) if p), None)
        if bad is not None:
            raise UserError(problems[bad] if self.world_size == 1 else f"rank {bad}: {problems[bad]}")
        saved = state["states"]
        targets: dict[str, torch.Tensor] = {}
        for name, st in self.states.items():
            split_tensors(st.state_dict(), name, targets)
        saved_keys = [k for name in self.states for k in tensor_keys(saved[name])]
        try:
            _read_fitting(path, targets, saved_keys, no_dist=not is_initialized())
        except UserError as e:  # the settings behind it, when the configs tell them, for the generic hint
            apart = settings_apart(path, self.config.to_yaml() if self.config is not None else "")
            raise UserError(str(e).replace(f" ({FIT_HINT})", f": {apart}") if apart else str(e)) from None
        for name, st in self.states.items():
            try:
                st.load_state_dict(join_tensors(saved[name], targets))
            except UserError as e:
                raise UserError(
                    f"{e}.\nTo keep this checkpoint's weights under the new settings, start a new run from them: "
                    f"model.init={path} run.dir=NEW_FOLDER (the optimizer and the data order start afresh)"
                ) from None
        if rank_file is not None:
            for name, st in self.rank_states.items():
                st.load_state_dict(join_tensors(rank_file[name], {}))
        self._last_saved = state["step"]
        return Restored(path=path, step=state["step"], world_size=state["world_size"], exact=rank_file is not None)

    def _read_json(self, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The checkpoint's state file, and this rank's own file when the world size is unchanged."""
        try:
            state = json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read checkpoint {path}: {e}") from None
        if state.get("format") != FORMAT_VERSION:
            raise UserError(f"checkpoint {path} has format {state.get('format')!r}; this version reads "
                            f"{FORMAT_VERSION}")
        saved = state["states"]
        missing = [name for name in self.states if name not in saved]
        said = getattr(self.states[missing[0]], "missing", None) if missing else None
        if said is not None:  # a state that names the setting behind its absence
            raise UserError(said(path))
        if missing:
            raise UserError(f"checkpoint {path} has no {', '.join(missing)} state (it holds {', '.join(saved)})")
        left = [name for name in saved if name not in self.states and name not in self.drop]
        if left:
            raise UserError(left_behind(path, left))
        if state["world_size"] != self.world_size:
            return state, None
        try:
            rank_file = json.loads((path / f"rank-{self.rank}.json").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read rank {self.rank}'s state in checkpoint {path}: {e}") from None
        for name in self.rank_states:
            if name not in rank_file:
                raise UserError(f"checkpoint {path} has no per-rank {name!r} state")
        return state, rank_file

