"""The one way a user's YAML is read: job configs, sweep files and the values of `--set`.

`UniqueKeyLoader` is PyYAML's safe loader that refuses a key given twice in one mapping (the
safe loader keeps the last and drops the first without a word); `read_mapping(path, what)` reads
a file with it and turns everything that can go wrong into one ConfigError line naming the file.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import yaml

from orchestrator.errors import ConfigError

MAX_YAML_VALUES = 1_000_000  # a config (or sweep) file's values, its aliases expanded
MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base`: its keys may be overridden, not duplicated


class DuplicateKey(yaml.YAMLError):
    """A mapping gives `key` twice: at line `line`, first at line `first` (both 1-based)."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        self.key, self.line, self.first = key, line, first
        super().__init__(f"duplicate key {key!r} (first at line {first})")


class UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing duplicate keys in every mapping (nested ones and flow style too).
    Keys brought in by a merge (`<<: *base`) may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = first_lines.get(key)
                except TypeError:  # an unhashable key: the safe loader's own error says so
                    continue
                if first is not None:
                    raise DuplicateKey(key, line, first)
                first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_text(text: str) -> Any:
    """A YAML value from text (one `--set` value), duplicate keys refused (DuplicateKey)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass: plain values only


def read_mapping(path: str, what: str = "config file") -> dict[str, Any]:
    """The mapping a YAML file holds. ConfigError, one line naming the file (`what`: "config file",
    "sweep file", "base config"), when it is missing, unreadable, not UTF-8, not YAML, empty
    (nothing but comments or null), not a mapping, gives a key twice, contains itself, nests too
    deeply or expands past MAX_YAML_VALUES values."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=UniqueKeyLoader)  # a SafeLoader subclass: plain values only
    except RecursionError:
        raise ConfigError(f"{what} {path} is not valid YAML: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({exc.reason}: byte "
                          f"0x{exc.object[exc.start]:02x})") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    except DuplicateKey as exc:
        prefix = "sweep error" if what == "sweep file" else "config error"
        raise ConfigError(f"{prefix}: {path}:{exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or getattr(exc, "reason", None) or exc).split())
        raise ConfigError(f"{what} {path}{where} is not valid YAML: {problem}") from None
    if raw is None:
        hint = "base and search (docs/sweeps.md)" if what == "sweep file" else "the job's sections (docs/config.md)"
        raise ConfigError(f"{what} {path} is empty (nothing but comments or null): give {hint}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must hold a mapping, got {type(raw).__name__}")
    why = yaml_shape_problem(raw)
    if why:
        raise ConfigError(f"{what} {path} is not valid YAML: {why}")
    return raw


def yaml_shape_problem(value: Any) -> Optional[str]:
    """Why a loaded YAML value cannot be a config, or None: it contains itself (an alias inside
    its own anchor), nests too deeply, or holds more than MAX_YAML_VALUES values once its aliases
    are expanded (a few lines of anchors can stand for billions of values, which every later
    copy or dump of the config would expand)."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(v: Any) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        key = id(v)
        if key in sizes:
            return sizes[key]
        if key in open_ids:
            raise _Shape("a value contains itself (an alias inside its own anchor)")
        open_ids.add(key)
        items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
        n = 1
        for item in items:
            n += size(item)
            if n > MAX_YAML_VALUES:
                raise _Shape(f"more than {MAX_YAML_VALUES:,} values once its aliases are expanded")
        open_ids.discard(key)
        sizes[key] = n
        return n

    try:
        size(value)
    except _Shape as exc:
        return str(exc)
    except RecursionError:
        return "nested too deeply"
    return None


class _Shape(Exception):
    pass
