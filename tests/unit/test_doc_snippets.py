"""What README.md and docs/*.md show is what the code does: every fenced code block is checked,
cheaply (no Ray, nothing trained or run).

- ```python: compiles, and each of its imports (`import X`, `from X import Y`) resolves for real;
  the rest is not run.
- ```yaml: parses; a run config (top-level keys all JobConfig sections) validates as a JobConfig,
  a sweep file (base, search, ...) as a sweep (its base and every combination checked).
- ```bash / sh / shell / console (and an untagged block whose every line is a command): each
  `python -m orchestrator SUB ...` / `orchestrator SUB ...` parses with the CLI's own argparse
  parser, and its config (with its --set overrides) validates when the file is in the repository;
  `python -m MODULE` names an importable module; `make TARGET` names a Makefile target; every
  path into the repository (examples/..., tests/..., ...) exists.
- ```text (output) and other languages are skipped.

Also: every intra-doc link `[..](file.md#anchor)` and every prose reference `docs/X.md, "Heading"`
lands on an existing file and heading, and docs/config.md has a table for every nested model.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import importlib
import importlib.util
import io
import os
import re
import shlex
from dataclasses import dataclass

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHELL = {"bash", "sh", "shell", "console", "zsh"}
REPO_DIRS = ("examples", "docs", "tests", "benchmarks", "orchestrator", "policies", "actors", ".ci")
REPO_FILES = ("Makefile", "README.md", "pyproject.toml")
CONTROL = {";", "&&", "||", "|", "&"}
REDIRECT = re.compile(r"^\d*(>>?|<|>&|&>)")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # the opening fence's line
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.lang or 'untagged'})"


def doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def fenced_blocks(path: str) -> list[Block]:
    """The fenced code blocks of one markdown file (``` or ~~~ fences, any indentation)."""
    blocks, fence, lang, start, body = [], None, "", 0, []
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            stripped = line.strip()
            if fence is None:
                m = re.match(r"^(```+|~~~+)\s*([\w+-]*)", stripped)
                if m:
                    fence, lang, start, body = m.group(1), m.group(2).lower(), i, []
            elif stripped.startswith(fence) and not stripped.strip(fence[0]):
                blocks.append(Block(path, start, lang, "".join(body)))
                fence = None
            else:
                body.append(line)
    assert fence is None, f"{path}:{start}: a code fence that is never closed"
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in fenced_blocks(path)]


# ---- shell ------------------------------------------------------------------------------------


def command_lines(block: Block) -> list[str]:
    """The block's commands, continuation lines joined; in a console block only the `$ ` lines."""
    out: list[str] = []
    pending = None
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if pending is None:
            if block.lang == "console":
                if not line.lstrip().startswith("$ "):
                    continue  # output
                line = line.lstrip()[2:]
            elif line.lstrip().startswith("$ "):
                line = line.lstrip()[2:]
        else:
            line = pending + " " + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = None
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    if pending:
        out.append(pending)
    return out


def split_commands(line: str) -> list[list[str]]:
    """One line -> its simple commands' words (comments dropped; split at ; && || | &; a
    redirection ends a command's arguments; leading VAR=value assignments dropped)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    words = list(lex)
    commands, current, redirected = [], [], False
    for w in words:
        if w in CONTROL:
            commands.append(current)
            current, redirected = [], False
        elif redirected or REDIRECT.match(w):
            redirected = True
        else:
            current.append(w)
    commands.append(current)
    out = []
    for cmd in commands:
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
            cmd = cmd[1:]
        if cmd:
            out.append(cmd)
    return out


def is_command_block(block: Block) -> bool:
    """An untagged block that is nothing but commands (a diagram or a formula is not)."""
    lines = command_lines(Block(block.path, block.line, "bash", block.text))
    return bool(lines) and all(re.match(r"^(\S*python3?\s|orchestrator\s|make\s|\.venv/bin/\S+\s)", ln)
                               for ln in lines)


def synopsis(words: list[str]) -> list[str]:
    """A usage line's optional parts as plain words: `[--set K=V]...` -> `--set K=V`; `...` dropped."""
    out = []
    for w in words:
        w = w.lstrip("[").rstrip(".").rstrip("]")
        if w and w != "...":
            out.append(w)
    return out


def cli_parser() -> argparse.ArgumentParser:
    from orchestrator.cli import main as cli

    for name in ("_parser", "parser", "build_parser", "make_parser"):
        fn = getattr(cli, name, None)
        if callable(fn):
            p = fn()
            if isinstance(p, argparse.ArgumentParser):
                return p
    raise AssertionError("orchestrator/cli/main.py has no function that returns its argparse parser")


def check_orchestrator(args: list[str], where: str) -> list[str]:
    """`orchestrator ARGS`: parses (subcommand, flags); a config or sweep file in the repository
    validates with the line's overrides."""
    args = synopsis(args)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = cli_parser().parse_args(args)
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        return [f"{where}: `orchestrator {' '.join(args)}`: {lines[-1] if lines else 'does not parse'}"]
    problems = []
    overrides = list(getattr(ns, "overrides", None) or [])
    if getattr(ns, "name", None):
        overrides.append(f"run.name={ns.name}")
    target = getattr(ns, "config", None) if ns.command in ("run", "simulate") else getattr(ns, "sweep", None)
    if target and os.path.isfile(os.path.join(REPO, target)):
        from orchestrator.errors import ConfigError

        try:
            if ns.command == "sweep":
                from orchestrator.sweep import load_sweep

                load_sweep(os.path.join(REPO, target), overrides)
            else:
                from orchestrator.config import JobConfig

                JobConfig.from_yaml(os.path.join(REPO, target), overrides)
        except ConfigError as exc:
            problems.append(f"{where}: `orchestrator {' '.join(args)}`: {exc}")
    return problems


def makefile_targets() -> set[str]:
    targets = set()
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.%/-]+(?:\s+[A-Za-z0-9_.%/-]+)*)\s*:(?!=)", line)
            if m and not line.startswith("\t"):
                targets.update(m.group(1).split())
    return targets


def repo_paths(words: list[str]) -> list[str]:
    """The words that are paths into the repository (also a --flag=PATH's value; a pytest node
    id's file)."""
    out = []
    for w in words:
        for part in (w, w.split("=", 1)[-1]):
            part = part.split("::", 1)[0].rstrip(",:")
            if re.search(r"[<>{}$]|\.\.\.|[A-Z]{3,}", part) and "*" not in part:
                continue  # a placeholder (CONFIG, <mode>), not a path
            if part.startswith("./"):
                part = part[2:]
            top = part.split("/", 1)[0]
            if (top in REPO_DIRS and "/" in part) or part in REPO_FILES:
                out.append(part)
    return sorted(set(out))


def check_shell(block: Block) -> list[str]:
    problems = []
    targets = None
    for line in command_lines(block):
        where = f"{block}: {line[:80]}"
        try:
            commands = split_commands(line)
        except ValueError as exc:
            problems.append(f"{where}: does not parse as shell ({exc})")
            continue
        for words in commands:
            exe = os.path.basename(words[0])
            for i, w in enumerate(words[:-1]):  # python -m MODULE, also after `ray job submit ... --`
                if re.fullmatch(r"python3?(\.\d+)?", os.path.basename(w)) and words[i + 1] == "-m" and i + 2 < len(words):
                    module = words[i + 2]
                    if module == "orchestrator":
                        problems += check_orchestrator(words[i + 3:], where)
                    elif importlib.util.find_spec(module) is None:
                        problems.append(f"{where}: no module {module!r} to run with python -m")
                    break
            if exe == "orchestrator":
                problems += check_orchestrator(words[1:], where)
            if exe == "make":
                targets = targets if targets is not None else makefile_targets()
                for t in words[1:]:
                    if not t.startswith("-") and "=" not in t and t not in targets:
                        problems.append(f"{where}: no Makefile target {t!r} (targets: {', '.join(sorted(targets))})")
            for path in repo_paths(words):
                if not glob.glob(os.path.join(REPO, path)):
                    problems.append(f"{where}: no such file in the repository: {path}")
    return problems


# ---- python and yaml --------------------------------------------------------------------------


def check_python(block: Block) -> list[str]:
    try:
        tree = ast.parse(block.text, filename=str(block))
        compile(tree, str(block), "exec")
    except SyntaxError as exc:
        return [f"{block}: does not compile: {exc.msg} (line {exc.lineno} of the block)"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as exc:
                    problems.append(f"{block}: `import {alias.name}`: {exc}")
        elif isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                problems.append(f"{block}: a relative import cannot be checked")
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                problems.append(f"{block}: `from {node.module} import ...`: {exc}")
                continue
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    problems.append(f"{block}: `from {node.module} import {alias.name}`: "
                                    f"{node.module} has no {alias.name}")
    return problems


def check_yaml(block: Block) -> list[str]:
    try:
        docs = [d for d in yaml.safe_load_all(block.text) if d is not None]
    except yaml.YAMLError as exc:
        return [f"{block}: not valid YAML: {' '.join(str(exc).split())}"]
    from orchestrator.config import JobConfig
    from orchestrator.errors import ConfigError
    from orchestrator.sweep import SweepConfig, plan_sweep

    problems = []
    for doc in docs:
        if not isinstance(doc, dict) or not doc:
            continue
        keys = set(doc)
        try:
            if keys <= set(JobConfig.model_fields):
                JobConfig.from_dict(doc)
            elif {"base", "search"} & keys and keys <= set(SweepConfig.model_fields):
                plan_sweep(SweepConfig.model_validate(doc), relative_to=REPO)
        except (ConfigError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            problems.append(f"{block}: {' '.join(str(exc).split())[:400]}")
    return problems


def check_block(block: Block) -> list[str]:
    if block.lang == "python" or block.lang == "py":
        return check_python(block)
    if block.lang in ("yaml", "yml"):
        return check_yaml(block)
    if block.lang in SHELL or (block.lang == "" and is_command_block(block)):
        return check_shell(block)
    return []  # text (output), diagrams, formulas


BLOCKS = all_blocks()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.path != "README.md"], ids=str)
def test_docs_code_block(block):
    problems = check_block(block)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.path == "README.md"], ids=str)
def test_readme_code_block(block):
    problems = check_block(block)
    assert not problems, "\n".join(problems)


def test_the_checks_find_what_they_should():
    """The checker itself: each kind of false claim is caught."""
    bad = [
        Block("x.md", 1, "python", "from orchestrator.data.sources import no_such_name\n"),
        Block("x.md", 1, "python", "def f(:\n"),
        Block("x.md", 1, "yaml", "strategy: {mode: no_such_mode}\n"),
        Block("x.md", 1, "yaml", "model: [unclosed\n"),
        Block("x.md", 1, "bash", "python -m orchestrator no-such-command x.yaml\n"),
        Block("x.md", 1, "bash", ".venv/bin/python -m orchestrator run examples/mnist_allreduce.yaml --no-such-flag\n"),
        Block("x.md", 1, "bash", "python -m orchestrator run examples/mnist_allreduce.yaml --set scaling.no_such=1\n"),
        Block("x.md", 1, "bash", "python -m orchestrator run examples/no_such_config.yaml\n"),
        Block("x.md", 1, "console", "$ make no-such-target\noutput line: make nothing\n"),
        Block("x.md", 1, "bash", "python -m no_such_module_here\n"),
        Block("x.md", 1, "", "python -m orchestrator run examples/mnist_allreduce.yaml \\\n    --bogus\n"),
    ]
    for block in bad:
        assert check_block(block), block.text
    good = [
        Block("x.md", 1, "python", "import os\nfrom orchestrator import ElasticTrainer, JobConfig\nundefined_name()\n"),
        Block("x.md", 1, "yaml", "strategy:\n  mode: easgd\n"),
        Block("x.md", 1, "console", "$ python -m orchestrator config-reference > /tmp/x.md\nmake bogus (output)\n"),
        Block("x.md", 1, "bash", "EO_X=1 python -m orchestrator run CONFIG [--set SECTION.KEY=VALUE]... [--name NAME]\n"),
        Block("x.md", 1, "text", "python -m orchestrator no-such-command\n"),
        Block("x.md", 1, "", "a diagram: python -m orchestrator run job.yaml -> fit()\n"),
    ]
    for block in good:
        assert not check_block(block), (block.text, check_block(block))


def quoted_errors(block: Block) -> list[tuple[list[str], str]]:
    """(the orchestrator command's arguments, the error line quoted after it) for each
    `$ ... orchestrator ARGS` line of a block followed by an `orchestrator: ...` line."""
    out, args = [], None
    for line in block.text.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            args = None
            for words in split_commands(line[2:]):
                for i, w in enumerate(words):
                    if w == "orchestrator" and (i == 0 or words[i - 1] == "-m"):
                        args = words[i + 1:]
        elif args is not None and line.startswith("orchestrator: "):
            out.append((args, line))
            args = None
    return out


def error_of(args: list[str]):
    """The one line `orchestrator ARGS` prints when its config (or sweep file, in the repository)
    fails to load; None when it loads (a later check's error cannot be told cheaply)."""
    from orchestrator.checks import one_line
    from orchestrator.errors import ConfigError

    with contextlib.redirect_stderr(io.StringIO()):
        ns = cli_parser().parse_args(args)
    target = getattr(ns, "config", None) if ns.command in ("run", "simulate") else getattr(ns, "sweep", None)
    if not target or not os.path.isfile(os.path.join(REPO, target)):
        return None
    overrides = list(getattr(ns, "overrides", None) or []) + ([f"run.name={ns.name}"] if getattr(ns, "name", None) else [])
    try:
        if ns.command == "sweep":
            from orchestrator.sweep import load_sweep

            load_sweep(os.path.join(REPO, target), overrides)
        else:
            from orchestrator.config import JobConfig

            JobConfig.from_yaml(os.path.join(REPO, target), overrides)
    except ConfigError as exc:
        return f"orchestrator: {one_line(exc)}".replace(os.path.join(REPO, ""), "")
    return None


QUOTED = [(b, args, line) for b in BLOCKS for args, line in quoted_errors(b)]


@pytest.mark.parametrize("block,args,quoted", QUOTED, ids=[f"{b}: {' '.join(a)[:60]}" for b, a, _ in QUOTED])
def test_quoted_config_errors_are_what_the_command_prints(block, args, quoted):
    """A doc that shows a command and the config error it prints (even in a text block) shows
    the error that command gives."""
    printed = error_of(args)
    if printed is not None:
        assert printed == quoted, f"{block}: `orchestrator {' '.join(args)}` prints\n  {printed}\nnot\n  {quoted}"


def test_a_wrong_quoted_error_is_caught():
    block = Block("x.md", 1, "text", "$ python -m orchestrator run examples/regression.yaml --set "
                  "stop.target_accuracy=0.9\norchestrator: config error: stop.target.metric: the regression task "
                  "has no metric 'test_accuracy'; choose one of test_loss, test_mse, test_mae, test_r2, train_loss\n")
    (args, quoted), = quoted_errors(block)
    assert error_of(args) not in (None, quoted)


# ---- links and references between the docs ----------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: str) -> list[str]:
    out, fence = [], False
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith(("```", "~~~")):
                fence = not fence
            elif not fence:
                m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
                if m:
                    out.append(m.group(1))
    return out


def anchors(path: str) -> set[str]:
    out, seen = set(), {}
    for h in headings(path):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def prose(path: str) -> str:
    """The file's text outside code blocks and code spans' fences, lines joined."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1[^\n]*$", "", text)
    return re.sub(r"\s*\n\s*", " ", text)


@pytest.mark.parametrize("path", doc_files())
def test_links_land(path):
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, mailto:
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(os.path.join(REPO, dest)):
            problems.append(f"{path}: link to {target}: no file {dest}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            problems.append(f"{path}: link to {target}: {dest} has no heading with that anchor")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", doc_files())
def test_section_references_land(path):
    """`docs/X.md, "Heading"` (or `X.md ("Heading")`) names a heading X.md has (the quoted words
    start one of its headings, backticks and case aside)."""
    problems = []
    for name, title in re.findall(r"((?:[\w.-]+/)*[\w.-]+\.md),?\s*\(?\"([^\"]+)\"", prose(path)):
        dest = name if "/" in name or name == "README.md" else f"docs/{name}"
        if not os.path.exists(os.path.join(REPO, dest)):
            problems.append(f"{path}: refers to {name}, which does not exist")
            continue
        norm = lambda s: " ".join(s.replace("`", "").lower().split())  # noqa: E731
        if not any(norm(h).startswith(norm(title)) for h in headings(dest)):
            problems.append(f"{path}: refers to {dest}, \"{title}\": no such heading there")
    assert not problems, "\n".join(problems)


PATH_IN_PROSE = re.compile(r"(?<![\w/.-])((?:%s)/[\w./*-]*[\w*])" % "|".join(re.escape(d) for d in REPO_DIRS))


def missing_paths(path: str) -> list[str]:
    """Paths into the repository named in a file's prose (examples/..., tests/..., globs too)
    that do not exist."""
    text, out = prose(path), []
    found_all = {m.group(1) for m in PATH_IN_PROSE.finditer(text) if text[m.end():m.end() + 1] not in ("<", "{", "$")}
    for found in sorted(found_all):  # (a path with a placeholder in it, e.g. examples/mnist_<mode>.yaml, is not one)
        if not glob.glob(os.path.join(REPO, found)):
            out.append(f"{path}: names {found}, which does not exist")
    return out


@pytest.mark.parametrize("path", doc_files())
def test_paths_named_in_the_docs_exist(path):
    problems = missing_paths(path)
    assert not problems, "\n".join(problems)


def test_config_reference_has_every_nested_model():
    """docs/config.md (orchestrator/cli/config_docs.py) has a row for every field of every model
    reachable from JobConfig and the sweep file, at any depth (PhaseOptimizer included)."""
    import typing

    from pydantic import BaseModel

    from orchestrator.config import JobConfig
    from orchestrator.cli.config_docs import reference_markdown
    from orchestrator.sweep import SweepConfig

    def models(model: type, seen: set) -> set:
        seen.add(model)
        for f in model.model_fields.values():
            stack = [f.annotation]
            while stack:
                a = stack.pop()
                if isinstance(a, type) and issubclass(a, BaseModel) and a not in seen:
                    models(a, seen)
                stack.extend(typing.get_args(a))
        return seen

    text = reference_markdown()  # docs/config.md is this (tests/unit/test_config.py)
    tables = []  # each table's field names (a row's key after its last dot)
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        keys = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
        tables.append({k.rsplit(".", 1)[-1] for k in keys})
    every = (models(JobConfig, set()) - {JobConfig}) | models(SweepConfig, set())  # JobConfig: the sections
    missing = sorted(m.__name__ for m in every if set(m.model_fields) not in tables)
    assert not missing, f"docs/config.md has no table for {missing}"
