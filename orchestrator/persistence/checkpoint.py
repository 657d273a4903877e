"""Checkpoints on any pyarrow filesystem: a local path, file://, s3://, gs://, hdfs://.

`CheckpointStore` keeps a run's checkpoints under <storage>/<run name>/ as

    ckpt-<step, 9 digits>[-<tag>].pt        the torch.save payload
    ckpt-<step, 9 digits>[-<tag>].pt.json   its sidecar: bytes, sha256, step, epoch, tag, wall_time

Each file is written under a temporary name (`.<name>.<random>.tmp`) and then moved into place;
the sidecar is written after its payload, so a payload whose write did not finish has no
sidecar (or one that does not match it) and is never trusted. After each save only the newest
`keep` checkpoints (by step, then the sidecar's wall time) are kept. `latest_good()` returns the
newest checkpoint whose sidecar matches it and which torch.load(weights_only=True) accepts,
recording in `skipped` each newer one it passed over and why.

`save_checkpoint` / `load_checkpoint` write and read a single named file (e.g. the final
`model.pt`) without a sidecar.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow.fs as pafs
import torch

from orchestrator.errors import ConfigError
from orchestrator.checks import bounded, one_line, writable_local_dir

CHECK_TIMEOUT_S = 30.0  # resolving a remote store (s3:// may look up the bucket's region)
SIDECAR = ".json"  # a payload's sidecar is its name plus this
_PAYLOAD = re.compile(r"^ckpt-(\d{9,})(?:-([A-Za-z0-9_]+))?\.pt$")
_TAG = re.compile(r"^[A-Za-z0-9_]*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # `s3:/bucket`, `notascheme::/x`: a URI missing its //


def filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path in it) of a local path or a URI."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    return pafs.FileSystem.from_uri(uri)


def check_storage(storage: str) -> None:
    """checkpoint.storage must name a filesystem pyarrow knows and, when local, a place a
    directory can be written; ConfigError otherwise. Nothing is created."""
    if "://" not in storage and _SCHEME.match(storage):
        raise ConfigError(f"config error: checkpoint.storage: malformed URI {storage!r}: a URI needs "
                          f"scheme://, and a local path cannot start with {storage.split(':', 1)[0]}:")

    def reach() -> tuple[pafs.FileSystem, str]:
        fs, root = filesystem_of(storage)
        if not isinstance(fs, pafs.LocalFileSystem):
            if not root.strip("/"):
                raise ValueError("it names no bucket or path")
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


def _write_atomic(fs: pafs.FileSystem, directory: str, name: str, data: bytes) -> None:
    """`data` to <directory>/<name> by way of a temporary name: a reader never sees half a file
    under the final name (on object stores the move is a copy, which the sidecar's checksum covers)."""
    tmp = f"{directory}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, f"{directory}/{name}")


def _serialize(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def save_checkpoint(storage: str, run_id: str, name: str, state: dict[str, Any]) -> str:
    """Write `state` to <storage>/<run_id>/<name> (no sidecar, never pruned); returns where it went."""
    fs, root = filesystem_of(storage)
    directory = f"{root.rstrip('/')}/{run_id}"
    fs.create_dir(directory, recursive=True)
    _write_atomic(fs, directory, name, _serialize(state))
    return f"{directory}/{name}" if "://" not in storage else f"{storage.rstrip('/')}/{run_id}/{name}"


def load_checkpoint(path: str) -> dict[str, Any]:
    fs, p = filesystem_of(path)
    with fs.open_input_stream(p) as f:
        data = f.read()
    return torch.load(io.BytesIO(data), weights_only=True)


def load_aside(ref: dict[str, Any]) -> dict[str, Any]:
    """The state a `CheckpointStore.save_aside` reference names, checked against its length and
    sha256; ValueError saying why when it is gone or differs."""
    try:
        fs, p = filesystem_of(ref["path"])
        with fs.open_input_stream(p) as f:
            data = f.read()
    except Exception as exc:
        raise ValueError(f"{ref['path']}: unreadable ({one_line(exc)})") from None
    state, why = decode_payload(data, ref)
    if state is None:
        raise ValueError(f"{ref['path']}: {why}")
    return state


def _load_error(exc: BaseException, limit: int = 300) -> str:
    """torch.load's complaint, short: weights_only refusals explain at length how to load
    untrusted files; the unpickler's own sentence is what names the problem."""
    msg = re.sub(r"\x1b\[[0-9;]*m", "", one_line(exc))
    _, marker, rest = msg.partition("WeightsUnpickler error:")
    if marker:
        msg = rest.split(" Please use", 1)[0].strip()
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def decode_payload(data: bytes, meta: dict[str, Any]) -> tuple[Optional[dict[str, Any]], str]:
    """(the state, "") if a checkpoint's bytes match their sidecar `meta` (length, sha256) and
    torch.load(weights_only=True) accepts them as a dict, else (None, why not)."""
    want = meta.get("bytes")
    if len(data) != want:
        return None, f"{len(data)} bytes, the sidecar says {want} (truncated or overwritten)"
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return None, "sha256 differs from the sidecar's (corrupt)"
    try:
        with warnings.catch_warnings():  # a foreign pickle's warning would be a second stderr line
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        return None, f"torch.load(weights_only=True) refused it ({_load_error(exc)})"
    if not isinstance(state, dict):
        return None, f"holds a {type(state).__name__}, not a dict"
    return state, ""


@dataclass(frozen=True)
class CheckpointEntry:
    name: str  # ckpt-<step>[-<tag>].pt
    path: str  # as the store's storage was given: a local path or a URI
    step: int
    tag: str
    meta: Optional[dict[str, Any]]  # the sidecar; None when it is missing or unreadable
    problem: str = ""  # why the sidecar is None (or does not describe this payload)

    @property
    def wall_time(self) -> float:
        t = (self.meta or {}).get("wall_time")
        return float(t) if isinstance(t, (int, float)) else 0.0


class CheckpointStore:
    """A run's checkpoints under <storage>/<run_name>/, each with an integrity sidecar, the
    newest `keep` kept (see the module docstring)."""

    def __init__(self, storage: str, run_name: str, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if not run_name or "/" in run_name or run_name in (".", ".."):
            raise ValueError(f"run_name must be a single directory name, got {run_name!r}")
        self.storage, self.run_name, self.keep = storage, run_name, keep
        self.fs, root = filesystem_of(storage)
        self.directory = f"{root.rstrip('/')}/{run_name}"
        self.skipped: list[tuple[str, str]] = []  # (name, why) from the last latest_good()

    def path_of(self, name: str) -> str:
        """A file of this store as the storage was given (a local path or a URI)."""
        if "://" not in self.storage:
            return f"{self.directory}/{name}"
        return f"{self.storage.rstrip('/')}/{self.run_name}/{name}"

    @staticmethod
    def step_of(name: str) -> Optional[int]:
        """The step of a checkpoint's file name (ckpt-<step>[-tag].pt), None for any other name."""
        m = _PAYLOAD.match(name)
        return int(m.group(1)) if m else None

    @staticmethod
    def name_for(step: int, tag: str = "") -> str:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not _TAG.match(tag):
            raise ValueError(f"tag must be letters, digits and underscores, got {tag!r}")
        return f"ckpt-{step:09d}" + (f"-{tag}" if tag else "") + ".pt"

    @classmethod
    def serialized(cls, state: dict[str, Any], step: int, epoch: int, tag: str = "") -> tuple[bytes, dict[str, Any]]:
        """`state` as the bytes of ckpt-<step>[-tag].pt and their sidecar."""
        name = cls.name_for(step, tag)
        data = _serialize(state)
        return data, {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "step": step,
                      "epoch": epoch, "tag": tag, "wall_time": time.time()}

    def save(self, state: dict[str, Any], step: int, epoch: int, tag: str = "") -> str:
        """Write `state` as ckpt-<step>[-tag].pt, then its sidecar, then drop all but the newest
        `keep` checkpoints; returns the payload's path."""
        return self.save_serialized(*self.serialized(state, step, epoch, tag))

    def save_serialized(self, data: bytes, meta: dict[str, Any]) -> str:
        """save() of a state already serialized (`serialized()`: the same bytes may go elsewhere too)."""
        name = meta["name"]
        self.fs.create_dir(self.directory, recursive=True)
        _write_atomic(self.fs, self.directory, name, data)
        _write_atomic(self.fs, self.directory, name + SIDECAR, json.dumps(meta, indent=1).encode())
        self.prune()
        return self.path_of(name)

    def save_aside(self, name: str, state: dict[str, Any]) -> dict[str, Any]:
        """`state` as <name> in the run's directory, beside the checkpoints and never pruned with
        them (a switch's guard: one copy that every checkpoint on its probation names); returns
        the reference they hold: its path, length and sha256 (`load_aside`)."""
        data = _serialize(state)
        self.fs.create_dir(self.directory, recursive=True)
        _write_atomic(self.fs, self.directory, name, data)
        return {"path": self.path_of(name), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def _scan(self) -> tuple[list[str], set[str]]:
        """The payload names and the sidecar names in the run's directory (temporary files and
        anything else ignored)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.directory, allow_not_found=True))
        names = [i.base_name for i in infos if i.type == pafs.FileType.File]
        payloads = [n for n in names if _PAYLOAD.match(n)]
        sidecars = {n for n in names if n.endswith(SIDECAR) and _PAYLOAD.match(n[: -len(SIDECAR)])}
        return payloads, sidecars

    def _read_sidecar(self, name: str, step: int) -> tuple[Optional[dict[str, Any]], str]:
        try:
            with self.fs.open_input_stream(f"{self.directory}/{name}{SIDECAR}") as f:
                meta = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return None, f"no sidecar {name}{SIDECAR} (its write did not finish)"
        except Exception as exc:
            return None, f"sidecar unreadable ({one_line(exc)})"
        if not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int) \
                or not isinstance(meta.get("sha256"), str):
            return None, "sidecar lacks bytes or sha256"
        if meta.get("name") != name or meta.get("step") != step:
            return None, f"sidecar describes {meta.get('name')!r}, not this payload"
        return meta, ""

    def list(self) -> list[CheckpointEntry]:
        """Every payload in the run's directory, oldest first (by step, then the sidecar's wall
        time), each with its sidecar (None and a `problem` when it has no usable one). Nothing is
        verified here: see latest_good()."""
        payloads, _ = self._scan()
        entries = []
        for name in payloads:
            m = _PAYLOAD.match(name)
            step, tag = int(m.group(1)), m.group(2) or ""
            meta, problem = self._read_sidecar(name, step)
            entries.append(CheckpointEntry(name, self.path_of(name), step, tag, meta, problem))
        return sorted(entries, key=lambda e: (e.step, e.wall_time, e.name))

    def prune(self) -> list[str]:
        """Delete all but the newest `keep` checkpoints (sidecar first, so a half-deleted one is
        never trusted) and sidecars whose payload is gone; returns the names deleted."""
        entries = self.list()
        _, sidecars = self._scan()
        doomed = [e.name for e in entries[:-self.keep]]
        alive = {e.name for e in entries[-self.keep:]}
        files = [f for n in doomed for f in (n + SIDECAR, n)]
        files += [s for s in sorted(sidecars) if s[: -len(SIDECAR)] not in alive and s[: -len(SIDECAR)] not in doomed]
        for f in files:
            try:
                self.fs.delete_file(f"{self.directory}/{f}")
            except FileNotFoundError:
                pass
        return files

    def verify(self, entry: CheckpointEntry) -> tuple[Optional[dict[str, Any]], str]:
        """(the state, "") if `entry` matches its sidecar and loads with weights_only=True, else
        (None, why not)."""
        if entry.meta is None:
            return None, entry.problem
        try:
            with self.fs.open_input_stream(f"{self.directory}/{entry.name}") as f:
                data = f.read()
        except FileNotFoundError:
            return None, "payload gone"
        except Exception as exc:
            return None, f"payload unreadable ({one_line(exc)})"
        return decode_payload(data, entry.meta)

    def latest_good(self) -> Optional[tuple[str, dict[str, Any]]]:
        """(path, state) of the newest checkpoint that passes verify(), or None; each newer one
        passed over is recorded in `self.skipped` as (name, why)."""
        self.skipped = []
        for entry in reversed(self.list()):
            state, why = self.verify(entry)
            if state is not None:
                return entry.path, state
            self.skipped.append((entry.name, why))
        return None
