"""The trained model in formats people load without this project (`checkpoint.export`).

- `safetensors`: `model.safetensors`, written by `safetensors.torch.save_model` (weights shared
  inside the model, e.g. GPT-2's tied embeddings, are stored once and come back tied:
  `safetensors.torch.load_model(model, path)`);
- `pretrained`: the model's own `save_pretrained(dir)` (a Hugging Face model: `config.json` and
  its weights; `AutoModelFor...from_pretrained(dir)` loads it).

Each is written for the final model and, with `checkpoint.keep_best`, the best epoch's, under
`<storage>/<run>/export/<final|best>/` (`model.safetensors`, `pretrained/`), and logged to the
run's MLflow artifacts at the same relative paths (`export/final/...`). Written on the driver
from the state it holds at the end (the model built by the factory, the state loaded).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

from orchestrator.errors import ConfigError

EXPORTS = ("safetensors", "pretrained")


def check_export(kinds: list[str], model: Any, factory: str) -> None:
    """What `kinds` needs is there: the safetensors package; a model with save_pretrained."""
    if "safetensors" in kinds:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise ConfigError("config error: checkpoint.export: safetensors needs the safetensors package "
                              "(pip install 'elastic-orchestrator[hf]')") from None
    if "pretrained" in kinds and not callable(getattr(model, "save_pretrained", None)):
        raise ConfigError(f"config error: checkpoint.export: pretrained needs a model with save_pretrained "
                          f"(a Hugging Face model); {factory} returns a {type(model).__name__}")


def write_local(model: Any, kinds: list[str], directory: str) -> list[str]:
    """`model` exported into the local `directory`; the files written, relative to it."""
    os.makedirs(directory, exist_ok=True)
    if "safetensors" in kinds:
        from safetensors.torch import save_model

        save_model(model, os.path.join(directory, "model.safetensors"))
    if "pretrained" in kinds:
        model.save_pretrained(os.path.join(directory, "pretrained"))
    return sorted(os.path.relpath(os.path.join(root, f), directory)
                  for root, _, files in os.walk(directory) for f in files)


def export_models(models: dict[str, Any], kinds: list[str], storage: str, run_dir: str, tracker: Any) -> dict[str, str]:
    """Each of `models` ({"final": model, "best": model}) exported to
    <storage>/<run_dir>/export/<which>/ and to the tracker's run as artifacts export/<which>/;
    where each went."""
    import pyarrow.fs as pafs

    from orchestrator.persistence.checkpoint import filesystem_of

    fs, root = filesystem_of(storage)
    where: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which, model in models.items():
            local = os.path.join(tmp, "export", which)
            write_local(model, kinds, local)
            target = f"{root.rstrip('/')}/{run_dir}/export/{which}"
            fs.create_dir(target, recursive=True)
            pafs.copy_files(local, target, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
            where[which] = target if "://" not in storage else f"{storage.rstrip('/')}/{run_dir}/export/{which}"
            tracker.log_dir(local, f"export/{which}")
    return where
