"""Checkpoints on any pyarrow filesystem: a local path, file://, s3://, gs://, hdfs://."""
from __future__ import annotations

import io
import os
from typing import Any

import pyarrow.fs as pafs
import torch


def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    return pafs.FileSystem.from_uri(uri)


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
