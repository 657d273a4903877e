"""Where a run's files go when it runs as a Ray job with a working directory.

Under `ray job submit --working-dir DIR` the job runs in Ray's temporary package directory
(`/tmp/ray/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/`): a relative
`checkpoint.storage` (the default `runs/checkpoints`) and MLflow's default store (`mlflow.db`
in the working directory) would land there, where the next job does not look once one file of
DIR changed (another hash) or the Ray session is new, so a resubmitted named run would start
again from epoch 1 in a new MLflow run. `settle_paths` puts them under a directory that outlives
the job instead: `$ORCHESTRATOR_HOME`, by default `~/elastic-orchestrator` on the node the
driver runs on (the head, for `ray job submit`), and says so. Absolute paths, URIs
(s3://, gs://, http://...) and `MLFLOW_TRACKING_URI` are left as they are; so is everything
outside a job's package directory.
"""
from __future__ import annotations

import os
from typing import Any, Optional

PACKAGE_MARK = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep
HOME_VAR = "ORCHESTRATOR_HOME"
DEFAULT_STORE = "mlflow.db"  # MLflow's own default store: sqlite:///mlflow.db, relative to the working directory


def job_package(cwd: Optional[str] = None) -> Optional[str]:
    """The Ray job package directory the process runs in (`.../working_dir_files/_ray_pkg_<hash>`), or None."""
    cwd = os.path.abspath(cwd or os.getcwd())
    at = cwd.find(PACKAGE_MARK)
    if at < 0:
        return None
    rest = cwd[at + len(PACKAGE_MARK):]
    return cwd[:at + len(PACKAGE_MARK)] + rest.split(os.sep, 1)[0]


def stable_home(env: Optional[dict] = None) -> str:
    """The directory that outlives a job: $ORCHESTRATOR_HOME, else ~/elastic-orchestrator."""
    env = os.environ if env is None else env
    return os.path.abspath(os.path.expanduser(env.get(HOME_VAR) or os.path.join("~", "elastic-orchestrator")))


def _relative_local(path: str) -> bool:
    return "://" not in path and not os.path.isabs(os.path.expanduser(path))


def _relative_sqlite(uri: str) -> Optional[str]:
    """The relative file of a `sqlite:///relative/path` URI (four slashes is absolute), else None."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return uri[len(prefix):]
    return None


def settle_paths(config: Any, cwd: Optional[str] = None, env: Optional[dict] = None) -> list[str]:
    """Inside a Ray job's package directory: a relative `checkpoint.storage` and a tracking store
    that would be a file in the package (none given and no MLFLOW_TRACKING_URI, or a relative
    sqlite URI or path) move under `stable_home()`; `config` is changed in place. The lines to
    tell the user (none outside a job package, or when nothing was relative)."""
    env = os.environ if env is None else env
    package = job_package(cwd)
    if package is None:
        return []
    home, said = stable_home(env), []
    storage = config.checkpoint.storage
    if _relative_local(storage):
        config.checkpoint.storage = os.path.join(home, storage)
        said.append(f"checkpoint.storage {storage!r} is relative and this Ray job runs in the temporary directory "
                    f"{package}: checkpoints go to {config.checkpoint.storage} instead, where the next job "
                    f"finds them ({HOME_VAR} sets the base)")
    uri = config.tracking.tracking_uri
    if uri is None and not env.get("MLFLOW_TRACKING_URI"):
        moved: Optional[str] = "sqlite:///" + os.path.join(home, DEFAULT_STORE)
    elif uri is not None and _relative_sqlite(uri) is not None:
        moved = "sqlite:///" + os.path.join(home, _relative_sqlite(uri))
    elif uri is not None and _relative_local(uri):  # a file store's directory
        moved = os.path.join(home, uri)
    else:
        moved = None
    if moved is not None:
        config.tracking.tracking_uri = moved
        said.append(f"the MLflow store ({uri or 'MLflow default: sqlite:///' + DEFAULT_STORE}) would be a file in "
                    f"that temporary directory: tracking to {moved} instead")
    if said:
        os.makedirs(home, exist_ok=True)  # the store's checks look for the directory the files will go to
    return said
