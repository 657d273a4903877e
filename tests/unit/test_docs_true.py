"""What docs/ names is what the code has, checked cheaply (no Ray, nothing run):

- docs/events.md's table lists every event kind the code records, and only those;
- every `section.key` a doc names in backticks is a field of the config models (JobConfig's
  sections, nested models too);
- every error line a doc quotes in a ```text block (or in backticks) is one the code can print:
  it holds, in order, the fixed pieces of a message written in orchestrator/, actors/ or policies/;
- the sizes the docs keep (docs/budgets.md): README.md at most 120 lines, a docs/ file at most
  400 lines, and no prose line in docs/ over 100 characters (table rows, code blocks and a line
  of one word, a path too long to break, aside).

test_doc_snippets.py checks the code blocks, links and paths; this file checks the prose's names.
"""
from __future__ import annotations

import ast
import glob
import os
import re
import typing
from functools import lru_cache

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_DIRS = ("orchestrator", "actors", "policies")
README_MAX_LINES = 120
DOC_MAX_LINES = 400
DOC_MAX_CHARS = 100


def doc_paths() -> list[str]:
    return sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def code_files() -> list[str]:
    return sorted(p for d in CODE_DIRS for p in glob.glob(os.path.join(REPO, d, "**", "*.py"), recursive=True))


@lru_cache(maxsize=None)
def parsed(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def markdown_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, line, whether it is code) for every line of a markdown text: a fenced
    block's lines, and an indented block's (4 spaces, after a blank line: a formula)."""
    out, fence, indented = [], None, False
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is not None:
            out.append((i, line, True))
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                fence = None
            continue
        m = re.match(r"^(```+|~~~+)", stripped)
        if m:
            fence = m.group(1)
            out.append((i, line, True))
            continue
        after_blank = i == 1 or not lines[i - 2].strip()
        indented = bool(stripped) and line.startswith("    ") and (indented or after_blank)
        out.append((i, line, indented))
    return out


def prose(text: str) -> str:
    """The text outside code blocks, lines joined (a code span may wrap)."""
    return " ".join(line.strip() for _, line, code in markdown_lines(text) if not code)


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", prose(text))


# ---- a. event kinds ---------------------------------------------------------------------------


def strings_in(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def kinds_in(tree: ast.AST) -> set[str]:
    """The event kinds a module records: `<x>.event("kind", ...)` (the Reporter's one way out,
    orchestrator/reporting/reporter.py), and the kinds of event dicts handed to it later:
    `{"kind": ...}`, `event["kind"] = ...`, `event.update(kind=...)`, `event.pop("kind", default)`,
    and what the fleet did on its own: `FleetEvent("kind", ...)` (the string constants of the
    value: `"a" if x else "b"` gives both)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "FleetEvent"
                and node.args):
            found.update(strings_in(node.args[0]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "event" and node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
            if node.func.attr == "update":
                found.update(s for kw in node.keywords if kw.arg == "kind" for s in strings_in(kw.value))
            if (node.func.attr in ("pop", "setdefault") and len(node.args) == 2
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"):
                found.update(strings_in(node.args[1]))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "kind":
                    found.update(strings_in(value))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
                        and target.slice.value == "kind"):
                    found.update(strings_in(node.value))
    return found


def emitted_kinds(paths: list[str]) -> set[str]:
    kinds: set[str] = set()
    for path in paths:
        kinds |= kinds_in(parsed(path))
    return kinds


def documented_kinds(text: str) -> set[str]:
    """The kinds in the first column of docs/events.md's table (`a` / `b` rows give both)."""
    kinds = set()
    for line in text.splitlines():
        m = re.match(r"^\|\s*([^|]+?)\s*\|", line)
        if m and "`" in m.group(1):
            kinds.update(re.findall(r"`([a-z_]+)`", m.group(1)))
    return kinds


def event_kind_problems(emitted: set[str], documented: set[str]) -> list[str]:
    problems = []
    if emitted - documented:
        problems.append(f"recorded by the code, missing from docs/events.md: {sorted(emitted - documented)}")
    if documented - emitted:
        problems.append(f"in docs/events.md, recorded nowhere in the code: {sorted(documented - emitted)}")
    return problems


def test_every_event_kind_is_documented_and_every_documented_kind_is_recorded():
    emitted, documented = emitted_kinds(code_files()), documented_kinds(read("docs/events.md"))
    assert len(emitted) >= 30, f"the scan found only {sorted(emitted)}: has the way events are recorded changed?"
    problems = event_kind_problems(emitted, documented)
    assert not problems, "\n".join(problems)


def test_a_kind_added_to_the_code_alone_is_caught(tmp_path):
    new = tmp_path / "new_module.py"
    new.write_text('def f(run):\n    run.report.event("kind_with_no_row", epoch=1)\n')
    emitted = emitted_kinds(code_files() + [str(new)])
    problems = event_kind_problems(emitted, documented_kinds(read("docs/events.md")))
    assert any("kind_with_no_row" in p for p in problems), problems


def test_the_event_scan_sees_each_way_of_recording_one():
    code = '''
run.report.event("a_direct", epoch=1)
ev = {"kind": "b_dict" if x else "c_dict", "epoch": 1}
ev["kind"] = "d_assigned"
ev.update(kind="e_updated")
kind = ev.pop("kind", "f_default")
other = {"name": "not_a_kind"}
'''
    assert kinds_in(ast.parse(code)) == {"a_direct", "b_dict", "c_dict", "d_assigned", "e_updated", "f_default"}
    table = "| kind | when |\n|---|---|\n| `x_one` | ... `not_this` |\n| `y_two` / `z_three` | ... |\n"
    assert documented_kinds(table) == {"x_one", "y_two", "z_three"}


# ---- b. config keys ---------------------------------------------------------------------------

# Backticked words that look like `section.key` and are not config keys.
NOT_KEYS = {
    "model.pt",  # the final model's file
    "model.safetensors",  # checkpoint.export's file
}


def sections() -> dict[str, type]:
    from orchestrator.config import JobConfig

    return {name: field.annotation for name, field in JobConfig.model_fields.items()}


def models_of(annotation) -> tuple[list[type], bool]:
    """The pydantic models an annotation holds (Optional, Union, list, dict values), and whether
    it also holds an open mapping (a dict or Any: any key below it is the user's)."""
    from pydantic import BaseModel

    found, open_map, stack = [], False, [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        elif a is typing.Any or a is dict or typing.get_origin(a) is dict:
            open_map = True
        stack.extend(typing.get_args(a))
    return found, open_map


def key_problem(key: str) -> str | None:
    """Why `a.b.c` is not a config key (None: it is one). An index (`phases[]`, `phases[0]`) is
    skipped; a key under a dict field (optimizer.kwargs.betas) is the user's."""
    parts = [re.sub(r"\[\d*\]$", "", p) for p in key.split(".")]
    top = sections()
    if parts[0] not in top:
        return f"no section {parts[0]!r}"
    models, open_map = models_of(top[parts[0]])
    for i, part in enumerate(parts[1:], 1):
        hit = next((m for m in models if part in m.model_fields), None)
        if hit is None:
            if open_map:
                return None
            where = ".".join(parts[:i])
            return f"{where} has no field {part!r}" + (f" (its fields: {', '.join(models[0].model_fields)})" if models else "")
        models, open_map = models_of(hit.model_fields[part].annotation)
    return None


def keys_named(text: str) -> set[str]:
    """The `section.key...` names in a text's code spans (the start of a span, or after `--set `
    or a space: `strategy.mode: easgd`, `--set data.batch_size=32`)."""
    names = set(sections())
    pattern = re.compile(r"(?<![\w./:<>-])(%s)((?:\.[A-Za-z_]\w*(?:\[\d*\])?)+)" % "|".join(names))
    out = set()
    for span in code_spans(text):
        for m in pattern.finditer(span):
            after = span[m.end():m.end() + 1]
            if after in ("(", "/") or m.group(0) in NOT_KEYS:
                continue  # a call (a Python attribute) or a path
            out.add(m.group(0))
    return out


@pytest.mark.parametrize("path", ["README.md"] + doc_paths())
def test_config_keys_named_in_the_docs_exist(path):
    problems = [f"{path}: `{key}`: {why}" for key in sorted(keys_named(read(path)))
                if (why := key_problem(key)) is not None]
    assert not problems, "\n".join(problems)


def test_the_key_check_finds_a_key_that_is_not_there():
    text = ("`strategy.mode` `strategy.adaptive.sync_mode` `stop.target.metric` `optimizer.kwargs.betas` "
            "`--set data.batch_size=32` `strategy.phases[].optimizer` `model.pt` `checkpoint.storage/<run>/` "
            "`strategy.no_such` `scaling.autoscale.max` `stop.target.nope` `examples.models:mnist_cnn`")
    named = keys_named(text)
    assert "examples.models" not in named and "model.pt" not in named
    bad = sorted(k for k in named if key_problem(k) is not None)
    assert bad == ["scaling.autoscale.max", "stop.target.nope", "strategy.no_such"], bad


# ---- c. quoted errors -------------------------------------------------------------------------

ERROR_LINE = re.compile(r"^(orchestrator: |config error: |error: |[A-Z]\w*Error: )")
MIN_FIXED = 12  # a quoted line holds this many characters of one message's fixed text, in order


def quoted_error_lines(path: str) -> list[tuple[int, str]]:
    """Error lines a doc quotes: a line of a ```text block (an untagged or an indented one too)
    that starts like one the CLI prints, and a code span that starts with `config error:` (line 0)."""
    text = read(path)
    out, lang = [], None  # lang: the open fence's tag; None outside a fence (an indented block)
    for i, line, code in markdown_lines(text):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if code and m:
            lang = m.group(2).lower() if lang is None else None
            continue
        if code and lang in (None, "text", "") and ERROR_LINE.match(line.strip()):
            out.append((i, line.strip()))
    out += [(0, span) for span in code_spans(text) if span.startswith("config error: ")]
    return out


def prose_nodes(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are prose, not messages: docstrings and the config's
    field descriptions (`Field(description=...)`), which would match any sentence about the code."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        elif isinstance(node, ast.keyword) and node.arg == "description":
            out.update(id(n) for n in ast.walk(node.value))
    return out


@lru_cache(maxsize=None)
def templates() -> tuple[tuple[str, ...], ...]:
    """Every message the code can write, as its fixed pieces in order: a string literal is one
    piece; an f-string (adjacent ones joined, as Python joins them) is cut at its placeholders.
    Docstrings and field descriptions aside; only messages with a piece of 8 characters or more."""
    out = set()
    for path in code_files():
        tree = parsed(path)
        skip = prose_nodes(tree)
        inside = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.JoinedStr):
                pieces, current = [], ""
                for value in node.values:
                    if isinstance(value, ast.Constant):
                        current += value.value
                    else:
                        pieces.append(current)
                        current = ""
                out.add(tuple(pieces + [current]))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside:
                out.add((node.value,))
    return tuple(sorted(p for p in out if max(map(len, p)) >= 8))


FIELD = re.compile(r"^(config error: )?[\w.\[\]:]+: ")  # the field a message names first: it proves nothing


def variants(pieces: tuple[str, ...]) -> list[tuple[str, ...]]:
    """A message as written, and without the field its first piece names (a caller may put
    another field there: optimizer.schedule.name's message is printed as optimizer.schedule's)."""
    m = FIELD.match(pieces[0])
    return [pieces, (pieces[0][m.end():],) + pieces[1:]] if m else [pieces]


def fixed_text_found(line: str) -> int:
    """How many characters of `line` are the fixed text of one message in the code, every piece
    of it found in order (the placeholders between them anything; a line that ends in `...` may
    stop after any piece). The leading `config error: FIELD: ` does not count: many messages
    start so, and a doc's field may be the code's placeholder."""
    text = line.removeprefix("orchestrator: ")
    head = FIELD.match(text)
    start = head.end() if head else 0
    truncated = text.rstrip().endswith("...")
    best = 0
    for message in templates():
        for pieces in variants(message):
            if sum(map(len, pieces)) <= best or max(pieces, key=len) not in text and not truncated:
                continue
            for k in (range(len(pieces), 0, -1) if truncated else [len(pieces)]):
                m = re.search(".*?".join(f"({re.escape(p)})" for p in pieces[:k]), text, flags=re.S)
                if m:
                    found = sum(m.end(g) - max(m.start(g), start) for g in range(1, k + 1) if m.end(g) > start)
                    best = max(best, found)
                    break
    return best


def printed_for_the_value(line: str):
    """For `config error: FIELD: ... (got VALUE)`, the line the main example prints with
    `--set FIELD=VALUE` (a rule of pydantic's has no words in this code); else None."""
    from tests.unit.test_doc_snippets import error_of

    m = re.match(r"^orchestrator: config error: ([a-z_]+(?:\.[a-z_]+)+): .*\(got ([^()]+)\)$", line)
    if m is None:
        return None
    return error_of(["run", "examples/mnist_allreduce.yaml", "--set", f"{m.group(1)}={m.group(2)}"])


def quoted_error_problems(path: str) -> list[str]:
    problems = []
    for lineno, line in quoted_error_lines(path):
        found = fixed_text_found(line)
        if found >= MIN_FIXED:
            continue
        if printed_for_the_value(line) == line:
            continue  # a rule of pydantic's, and the main example prints this line for that value
        problems.append(f"{path}:{lineno or '(a code span)'}: {line[:120]!r}: no message in the code "
                        f"has these words ({found} characters of one message's fixed text found)")
    return problems


@pytest.mark.parametrize("path", ["README.md"] + doc_paths())
def test_quoted_errors_are_the_codes(path):
    problems = quoted_error_problems(path)
    assert not problems, "\n".join(problems)


def test_a_quoted_error_the_code_never_prints_is_caught():
    real = ("orchestrator: config error: scaling.shards: hogwild keeps the whole parameter vector in one shard's "
            "shared memory; set it to 1 (got 4)")
    assert fixed_text_found(real) >= MIN_FIXED
    for made_up in ("orchestrator: config error: scaling.shards: hogwild needs exactly one parameter server "
                    "holding the model (got 4)",
                    "config error: strategy.mode: the mode cannot be changed while a rollback is pending",
                    "config error: optimizer.name: lbfgs is not supported here"):
        assert fixed_text_found(made_up) < MIN_FIXED, made_up


# ---- sizes (docs/budgets.md) ------------------------------------------------------------------


def test_readme_fits_its_budget():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the budget is {README_MAX_LINES} (docs/budgets.md)"


@pytest.mark.parametrize("path", doc_paths())
def test_doc_fits_its_budget(path):
    text = read(path)
    problems = []
    if text.count("\n") > DOC_MAX_LINES:
        problems.append(f"{path}: {text.count(chr(10))} lines; the budget is {DOC_MAX_LINES} (split it by topic)")
    for i, line, code in markdown_lines(text):
        if not code and not line.lstrip().startswith("|") and len(line) > DOC_MAX_CHARS and " " in line.strip():
            problems.append(f"{path}:{i}: {len(line)} characters; wrap prose at {DOC_MAX_CHARS}")
    assert not problems, "\n".join(problems)
