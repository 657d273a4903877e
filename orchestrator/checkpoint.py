"""Checkpoints on any pyarrow filesystem: a local path, file://, s3://, gs://, hdfs://."""
from __future__ import annotations

import io
import os
from typing import Any

import pyarrow.fs as pafs
import torch

from orchestrator.errors import ConfigError
from orchestrator.checks import bounded, one_line, writable_local_dir

CHECK_TIMEOUT_S = 30.0  # resolving a remote store (s3:// may look up the bucket's region)


def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    return pafs.FileSystem.from_uri(uri)


def check_storage(storage: str) -> None:
    """checkpoint.storage must name a filesystem pyarrow knows and, when local, a place a
    directory can be written; ConfigError otherwise. Nothing is created."""
    def reach() -> tuple[pafs.FileSystem, str]:
        fs, root = _resolve(storage)
        if not isinstance(fs, pafs.LocalFileSystem):
            fs.get_file_info(root)  # the store answers (a missing path is fine: it is created)
        return fs, root

    try:
        fs, root = bounded(reach, CHECK_TIMEOUT_S, f"opening {storage}")
    except Exception as exc:
        raise ConfigError(f"config error: checkpoint.storage: cannot open {storage} ({one_line(exc)})") from None
    if isinstance(fs, pafs.LocalFileSystem):
        why = writable_local_dir(root)
        if why:
            raise ConfigError(f"config error: checkpoint.storage: cannot write checkpoints to {storage} ({why})")


def save_checkpoint(storage: str, run_id: str, name: str, state: dict[str, Any]) -> str:
    """Write `state` to <storage>/<run_id>/<name>; returns where it went."""
    fs, root = _resolve(storage)
    directory = f"{root.rstrip('/')}/{run_id}"
    fs.create_dir(directory, recursive=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    tmp, final = f"{directory}/.{name}.tmp", f"{directory}/{name}"
    with fs.open_output_stream(tmp) as f:
        f.write(buf.getvalue())
    fs.move(tmp, final)  # a reader never sees half a checkpoint
    return final if "://" not in storage else f"{storage.rstrip('/')}/{run_id}/{name}"


def load_checkpoint(path: str) -> dict[str, Any]:
    fs, p = _resolve(path)
    with fs.open_input_stream(p) as f:
        data = f.read()
    return torch.load(io.BytesIO(data), weights_only=True)
