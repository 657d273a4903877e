"""Going on from a run's newest good checkpoint: by name (`run --name NAME`, `run.name`), or
`python -m orchestrator resume RUN`.

A named run keeps its checkpoints in `<checkpoint.storage>/<NAME>/`; `named_checkpoint` finds the
newest good one there, so running the same command again after a crash goes on from it (a
finished run, or a config that differs in more than `stop`, is refused with the reason).

RUN is the run's checkpoint directory (`<checkpoint.storage>/<mlflow run id>`, a local path or
any pyarrow filesystem URI) or its MLflow run id (its `checkpoint.storage` param says where the
checkpoints are). The checkpoint holds the job's config, the MLflow run id, the model, the
optimizer state, the step, and the run's position (totals, the switch policy's place, the
phases so far, the training clock): the run goes on at the epoch after the checkpoint's, in the
same MLflow run (metrics continue at the right step). A truncated or corrupt checkpoint is
skipped for the one before it (the `resumed` event and the CLI say which).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from orchestrator.persistence.checkpoint import CheckpointStore
from orchestrator.checks import bounded, one_line
from orchestrator.errors import ConfigError


# what a checkpoint a run can go on from holds (orchestrator/control/controller.py writes and reads them)
RESUME_KEYS = {"config": dict, "run": dict, "mlflow_run_id": str, "epoch": int, "step": int, "model": dict}
LOOKUP_TIMEOUT_S = 30.0  # listing a run's checkpoints, looking a run id up in MLflow


def find_checkpoint(run: str, tracking_uri: Optional[str] = None) -> tuple[str, dict[str, Any], list]:
    """(path, state, skipped) of RUN's newest good checkpoint; ConfigError naming what is
    missing otherwise. Nothing is written (an MLflow store that is not there is not created)."""
    if "\x00" in run:
        raise ConfigError(f"resume: {run!r} is not a path or run id (it holds a NUL byte)")
    if "://" in run or os.path.isdir(run):
        directory = run.rstrip("/")
    elif os.path.lexists(run):
        raise ConfigError(f"resume: {run} is a file, not a run's checkpoint directory "
                          "(<checkpoint.storage>/<mlflow run id>) or an MLflow run id")
    elif os.sep in run or run.startswith("."):
        raise ConfigError(f"resume: no such directory: {run}")
    else:
        directory = _directory_of_run_id(run, tracking_uri)
    storage, _, run_name = directory.rpartition("/")
    if not run_name:
        raise ConfigError(f"resume: {run} is not a run's checkpoint directory")

    store, found = _newest_good(storage or "/", run_name, directory, "resume")
    if found is None:
        why = "; ".join(f"{name}: {reason}" for name, reason in store.skipped) or "none written"
        raise ConfigError(f"resume: no usable checkpoint in {directory} ({why})")
    path, state = found
    _check_resumable(path, state, store, f"resume: {run}", "nothing to go on from")
    return path, state, list(store.skipped)


def _newest_good(storage: str, run_name: str, directory: str, who: str) -> tuple[CheckpointStore, Any]:
    """The run's store and its newest good (path, state) or None, listed within LOOKUP_TIMEOUT_S;
    ConfigError (prefixed `who`) when the store cannot be opened."""
    def latest() -> tuple[CheckpointStore, Any]:
        store = CheckpointStore(storage, run_name, keep=1_000_000)
        return store, store.latest_good()

    try:
        return bounded(latest, LOOKUP_TIMEOUT_S, f"listing {directory}")
    except Exception as exc:  # a URI pyarrow cannot open, a store that does not answer
        raise ConfigError(f"{who}: cannot open {directory} ({one_line(exc)})") from None


def _check_resumable(path: str, state: dict[str, Any], store: CheckpointStore, who: str, finished_why: str) -> None:
    """A checkpoint a run can go on from: it holds a run position, and the run did not finish."""
    if "run" not in state or "config" not in state:
        raise ConfigError(f"resume: {path} holds no run position (written by a version that could not resume)")
    for key, kind in RESUME_KEYS.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"resume: {path} is not a checkpoint a run can go on from: its {key} is "
                              f"{type(value).__name__ if key in state else 'missing'}, not {kind.__name__}")
    if state.get("finished"):
        raise ConfigError(f"{who} already finished (epoch {state['epoch']}, MLflow run {state['mlflow_run_id']}; "
                          f"its model is {store.path_of('model.pt')}): {finished_why}")


FROM_MEMORY = "from_memory"  # a state that came from a keeper says so (the `resumed` event's field)
# a named run may be given other stop rules when it goes on (e.g. more epochs), and keep its
# checkpoints in memory or not (checkpoint.in_memory: off, a keeper's copy is not looked at)
MAY_DIFFER = ("stop.", "checkpoint.in_memory")


def named_checkpoint(config: Any) -> tuple[Optional[str], Optional[dict[str, Any]], list]:
    """(path, state, skipped) of the newest good checkpoint of the run `config.run.name` in
    `config.checkpoint.storage`, or (None, None, skipped) when there is none (a new run). ConfigError
    when that run finished, or when `config` differs from the one it was started with in more
    than the stop rules."""
    from orchestrator.config import JobConfig

    name, storage = config.run.name, config.checkpoint.storage
    directory = f"{storage.rstrip('/')}/{name}"
    store, found = _newest_good(storage, name, directory, f"run {name}")
    if found is None:
        return None, None, list(store.skipped)
    path, state = found
    _check_named(config, path, state, store, directory)
    return path, state, list(store.skipped)


def _check_named(config: Any, path: str, state: dict[str, Any], store: CheckpointStore, directory: str) -> None:
    """The named run `config` can go on from `state`: it did not finish, and its config differs from
    the one it was started with in the stop rules at most; ConfigError otherwise."""
    from orchestrator.config import JobConfig

    name = config.run.name
    _check_resumable(path, state, store, f"run {name}",
                     f"nothing is retrained. Give another --name to train again, or remove {directory}")
    before = JobConfig.from_dict(state["config"]).flat()
    now = config.flat()
    changed = sorted(k for k in set(before) | set(now)
                     if before.get(k) != now.get(k) and not k.startswith(MAY_DIFFER))
    if changed:
        shown = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise ConfigError(f"run {name} was started with another config ({shown}{more}); only stop.* and "
                          f"checkpoint.in_memory* may change when a run goes on. Give another --name for a new run")


def newer_in_memory(config: Any, stored_path: Optional[str], stored: Optional[dict[str, Any]] = None) \
        -> tuple[Optional[str], Optional[dict[str, Any]], str]:
    """checkpoint.in_memory: (its label, state, "") of the copy the keeper of this run's checkpoint
    directory holds (orchestrator/persistence/memory_copy.py), when it is of the same MLflow run as
    the store's newest good checkpoint `stored_path` (its state `stored`) and at least as new (None:
    the store has none); else (None, None, why not). The run is named (`config.run.name`), or
    `stored_path` says its directory (`resume`). ConfigError as for a stored checkpoint when the
    copy says the run finished or, for a named run, that it was started with another config.
    Needs a connected Ray."""
    from orchestrator.persistence.memory_copy import directory_key, label, look

    if stored_path:  # the directory the store's checkpoint is in
        directory = os.path.dirname(stored_path)
    elif config.run.name:
        directory = f"{config.checkpoint.storage.rstrip('/')}/{config.run.name}"
    else:
        return None, None, "the run has no name and no stored checkpoint"
    step = CheckpointStore.step_of(os.path.basename(stored_path or ""))

    def older(meta: dict[str, Any]) -> str:
        if step is not None and step > meta["step"]:
            return f"the store's {os.path.basename(stored_path)} is newer than the copy in memory ({meta['name']})"
        return ""

    meta, state, why = look(directory_key(directory), older)
    if state is None:
        return None, None, why
    if stored is not None and state.get("mlflow_run_id") != stored.get("mlflow_run_id"):
        return None, None, (f"the copy in memory ({meta['name']}) is of MLflow run {state.get('mlflow_run_id')}, "
                            f"the store's checkpoints of {stored.get('mlflow_run_id')}")
    storage, _, run_dir = directory.rpartition("/")
    where, store = label(meta), CheckpointStore(storage or "/", run_dir, keep=1_000_000)
    if config.run.name:
        _check_named(config, where, state, store, directory)
    else:
        _check_resumable(where, state, store, f"resume: {run_dir}", "nothing to go on from")
    return where, {**state, FROM_MEMORY: where}, ""


def _directory_of_run_id(run_id: str, tracking_uri: Optional[str]) -> str:
    from mlflow.tracking import MlflowClient

    from orchestrator.reporting.tracking import check_store, store_missing

    def unknown(why: str) -> ConfigError:
        return ConfigError(f"resume: {run_id} is neither a checkpoint directory nor an MLflow run id the tracking "
                           f"store knows ({why})")

    check_store(tracking_uri, "--tracking-uri")  # a scheme MLflow has no store for; a server that does not answer
    missing = store_missing(tracking_uri)
    if missing:  # looking a run up would create the store (an mlflow.db in the working directory)
        raise unknown(missing)
    try:
        params = bounded(lambda: MlflowClient(tracking_uri).get_run(run_id).data.params, LOOKUP_TIMEOUT_S,
                         f"MLflow at {tracking_uri or 'the default store'}")
    except Exception as exc:
        raise unknown(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    storage = params.get("checkpoint.storage")
    if not storage:
        raise ConfigError(f"resume: MLflow run {run_id} has no checkpoint.storage param")
    if "://" not in storage:
        storage = os.path.abspath(storage)
    name = params.get("run.name")  # a named run's checkpoints are under its name
    return f"{storage.rstrip('/')}/{name if name not in (None, '', 'None') else run_id}"
