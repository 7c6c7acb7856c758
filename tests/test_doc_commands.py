"""Every command in README.md and docs/ runs as written on a fresh clone after the README's set-up.

The pages hold commands in fenced ```bash blocks only (other fenced blocks name their language: toml, json, text),
spelled one way: `.venv/bin/python`, `.venv/bin/deepspeed`, `.venv/bin/torchrun`, `.venv/bin/nshard-*` or
`bash launch/*.sh` (set-up creates .venv but never activates it). For each command this test checks that the module
or script exists, that every flag is one its parser accepts (nshard's tools through their `build_parser()`,
DeepSpeed's launcher and torchrun through their own parsers, the training script's arguments after them), and that
every repository path it names exists. Inline code that is a command (`.venv/bin/...`, `bash launch/...`) is
checked the same way. Nothing is run: a command's flags are checked, not its effect.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
TOP_LEVEL = {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {"runs"}
SHELL_LANGUAGES = {"bash", "sh", "shell"}
OTHER_LANGUAGES = {"toml", "json", "jsonl", "text", "python", "yaml", "ini", "diff", "console", "markdown"}
PLAIN_COMMANDS = {"cd", "export", "mkdir", "rm", "cp", "mv", "ls", "cat", "env", "git", "ssh", "rsync", "scp", "sudo",
                  "apt-get", "nvidia-smi", "echo", "grep", "tee", "sha256sum", "tar", "kill", "sleep", "curl", "ip",
                  "tc", "test", "printf", "head", "tail", "wc", "du", "df", "jq", "diff", "nproc", "lscpu", "date",
                  "chmod", "ln", "touch", "find", "sort", "uniq", "mount", "unset", "source", "wait", "pkill", "true",
                  "realpath", "which", "free", "numactl", "taskset"}
PREFIXES = {"time", "sudo", "nohup", "env", "exec"}
BARE = {"python", "python3", "pip", "pip3", "pytest", "deepspeed", "torchrun", "ds_report"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OWN_PACKAGES = {"nshard", "launch", "analysis"}
INLINE_COMMAND = re.compile(r"^(\.venv/bin/|bash launch/|python3? -m |deepspeed |torchrun |pytest )")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    inline: bool = False

    def __str__(self):
        return f"{self.page}:{self.line}: {self.text}"


def fenced_blocks(path: Path):
    """(language, first line number, lines) of each fenced block; lines outside fences as ('', n, [line])."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not opening:
            yield None, i + 1, [lines[i]]
            i += 1
            continue
        indent, fence, language = opening.groups()
        body, start = [], i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        yield language.lower(), start, body


def shell_lines(start: int, body: list[str]):
    """Logical lines of a shell block (continuations joined, heredoc bodies skipped), with their line numbers."""
    out, pending, first, heredoc = [], "", None, None
    for offset, line in enumerate(body):
        number = start + 1 + offset
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        if first is None:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
        if marker:
            heredoc = marker.group(1)
        if text and not text.startswith("#"):
            out.append((first, text))
        first = None
    return out


def page_commands() -> tuple[list[Command], list[str]]:
    commands, problems = [], []
    for path in PAGES:
        page = path.relative_to(REPO).as_posix()
        previous_blank = True
        for language, start, body in fenced_blocks(path):
            if language is None:
                line = body[0]
                if previous_blank and re.match(r"^( {4,}|\t)\S", line) and not re.match(r"^\s*([-*+]|\d+\.)\s", line):
                    stripped = line.strip()
                    if INLINE_COMMAND.match(stripped) or stripped.split(" ")[0] in BARE:
                        problems.append(f"{page}:{start}: a command in an indented block: put it in a ```bash block")
                for span in re.findall(r"`([^`]+)`", line):
                    if INLINE_COMMAND.match(span.strip()):
                        commands.append(Command(page, start, span.strip(), inline=True))
                previous_blank = not line.strip()
                continue
            previous_blank = True
            if not language:
                problems.append(f"{page}:{start}: a fenced block without a language: name it (bash, toml, json, text)")
            elif language in SHELL_LANGUAGES:
                commands += [Command(page, n, text) for n, text in shell_lines(start, body)]
            elif language not in OTHER_LANGUAGES:
                problems.append(f"{page}:{start}: a fenced block in {language!r}: use bash, toml, json or text")
    return commands, problems


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of one logical line: split on ; && || |, redirections and their targets dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out, current, skip_next = [], [], False
    for token in lexer:
        if skip_next:
            skip_next = False
            continue
        if token and set(token) <= set(";&|()"):
            if current:
                out.append(current)
            current = []
            continue
        if token and set(token) <= set("<>&"):
            if current and current[-1].isdigit():
                current.pop()
            skip_next = True
            continue
        current.append(token)
    if current:
        out.append(current)
    return out


# ---- parsers ------------------------------------------------------------------------------------------------------


def console_scripts() -> dict[str, str]:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def main_module(name: str) -> str:
    """The module whose build_parser() a `python -m NAME` runs: a package's __main__ imports its main."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        raise LookupError(f"no module {name}")
    if spec.submodule_search_locations:
        main = Path(list(spec.submodule_search_locations)[0]) / "__main__.py"
        if not main.is_file():
            raise LookupError(f"package {name} has no __main__.py")
        for node in ast.walk(ast.parse(main.read_text())):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "main" for alias in node.names):
                return node.module
        raise LookupError(f"{main} imports no main")
    return name


@functools.cache
def tool_parser(module: str) -> argparse.ArgumentParser:
    loaded = importlib.import_module(main_module(module))
    if not hasattr(loaded, "build_parser"):
        raise LookupError(f"{module} has no build_parser(): give it one, so its flags can be checked")
    return loaded.build_parser()


def options_of(parser: argparse.ArgumentParser, args: list[str]) -> tuple[set[str], list[str]]:
    """The option strings `parser` takes for `args`, descending into the subcommand the args name."""
    options = {s for action in parser._actions for s in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((a for a in args if a in action.choices), None)
            if chosen is None:
                return options, [f"no subcommand of {', '.join(action.choices)}"]
            sub, problems = options_of(action.choices[chosen], args[args.index(chosen) + 1:])
            return options | sub, problems
    return options, []


def flag_problems(parser: argparse.ArgumentParser, args: list[str], what: str) -> list[str]:
    options, problems = options_of(parser, args)
    for arg in args:
        if arg.startswith("-") and not re.match(r"^-\d", arg) and arg != "--":
            flag = arg.split("=", 1)[0]
            if flag not in options:
                problems.append(f"{what} takes no {flag}")
    return problems


@functools.cache
def deepspeed_parse(args: tuple[str, ...]):
    from deepspeed.launcher.runner import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parse_args(list(args)), None
    except SystemExit:
        return None, "DeepSpeed's launcher refuses these arguments"


def script_problems(script: str, args: list[str]) -> list[str]:
    """A script a launcher starts: nshard's training script (its parser), or another that must exist."""
    if script in (".venv/bin/nshard-train", "nshard/train.py") or script.endswith("/nshard/train.py"):
        return flag_problems(tool_parser("nshard.train"), args, "nshard/train.py")
    if not (REPO / script).exists() and not script.startswith("$"):
        return [f"no script {script}"]
    return []


def shell_script_problems(script: str, args: list[str]) -> list[str]:
    path = REPO / script
    if not path.is_file():
        return [f"no script {script}"]
    name = path.name
    if name == "study.sh":  # [PLAN] [nshard.study args...]
        rest = args[1:] if args and not args[0].startswith("-") else args
        return flag_problems(tool_parser("nshard.study"), rest, "launch/study.sh (nshard.study)")
    if name == "run.sh":  # [--hostfile FILE] [launcher args...] -- train args
        split = args.index("--") if "--" in args else len(args)
        launcher = [a for a in args[:split]]
        _, refused = deepspeed_parse(tuple(launcher + ["nshard/train.py"]))
        problems = [f"launch/run.sh: {refused}: {launcher}"] if refused else []
        return problems + flag_problems(tool_parser("nshard.train"), args[split + 1:], "nshard/train.py")
    text = path.read_text()  # other scripts parse their own options: each flag must be one the script names
    return [f"{script} names no {a.split('=')[0]}" for a in args if a.startswith("--") and a.split("=")[0] not in text]


def python_problems(args: list[str]) -> list[str]:
    if args[:1] == ["-c"]:
        return []
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "pytest":
            return [f"no test file {a.split('::')[0]}" for a in rest
                    if a.startswith("tests/") and not (REPO / a.split("::")[0]).exists()]
        if module.split(".")[0] not in OWN_PACKAGES:  # another project's tool (lm_eval): it must be installed
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            return [] if found else [f"no module {module} (is it in the extras launch/setup.sh installs?)"]
        try:
            return flag_problems(tool_parser(module), rest, f"python -m {module}")
        except LookupError as exc:
            return [str(exc)]
    if args and args[0].endswith(".py"):
        if not (REPO / args[0]).is_file():
            return [f"no script {args[0]}"]
        module = args[0][:-3].replace("/", ".")
        try:
            return flag_problems(tool_parser(module), args[1:], args[0])
        except LookupError as exc:
            return [str(exc)]
    return [f"python {' '.join(args[:1])}: give -m MODULE, a script path or -c"]


def path_problems(words: list[str]) -> list[str]:
    problems = []
    for word in words:
        for value in [word, *word.split("=", 1)[1:]]:
            value = value.split("::")[0].rstrip(",")
            first = value.split("/")[0]
            if first in TOP_LEVEL and ("/" in value or value == first) and not any(c in value for c in "*?$[{"):
                if not (REPO / value).exists():
                    problems.append(f"no {value} in the repository")
    return problems


def command_problems(words: list[str]) -> list[str]:
    while words and (ASSIGNMENT.match(words[0]) or words[0] in PREFIXES):
        words = words[1:]
    if not words:
        return []
    head, args = words[0], words[1:]
    problems = path_problems(args)
    problems += [f"{w!r} looks like a placeholder: write a concrete example" for w in args if PLACEHOLDER.match(w)]
    if head in BARE or head.startswith("nshard-"):
        return problems + [f"bare {head}: set-up never activates .venv, so write .venv/bin/{head}"
                           + (" (or .venv/bin/python -m ...)" if head.startswith(("python", "pytest", "pip")) else "")]
    if head in (".venv/bin/python", ".venv/bin/python3"):
        return problems + python_problems(args)
    if head == ".venv/bin/deepspeed":
        parsed, refused = deepspeed_parse(tuple(args))
        if refused:
            return problems + [refused]
        return problems + script_problems(parsed.user_script, parsed.user_args)
    if head == ".venv/bin/torchrun":
        from torch.distributed.run import get_args_parser

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parsed = get_args_parser().parse_args(args)
        except SystemExit:
            return problems + ["torchrun refuses these arguments"]
        return problems + script_problems(parsed.training_script, parsed.training_script_args)
    if head.startswith(".venv/bin/nshard-"):
        module = console_scripts().get(head.removeprefix(".venv/bin/"))
        if module is None:
            return problems + [f"{head} is no console script in pyproject.toml"]
        return problems + flag_problems(tool_parser(module), args, head)
    if head == "bash":
        if not args or not args[0].startswith("launch/"):
            return problems + ["bash runs launch/*.sh scripts here"]
        return problems + shell_script_problems(args[0], args[1:])
    if head.startswith(".venv/bin/"):
        return problems + [f"{head}: use .venv/bin/python -m for Python tools"]
    if head in PLAIN_COMMANDS:
        return problems
    return problems + [f"{head}: not a command these pages use (add it to PLAIN_COMMANDS if it is one)"]


COMMANDS, PAGE_PROBLEMS = page_commands()


def test_the_pages_hold_commands_only_in_bash_blocks():
    assert PAGE_PROBLEMS == []
    assert len([c for c in COMMANDS if not c.inline]) >= 20, "the extraction found too few commands"


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_command_on_the_page_runs_as_written(page):
    found = []
    for command in (c for c in COMMANDS if c.page == page):
        try:
            simple = simple_commands(command.text)
        except ValueError as exc:
            found.append(f"{command}: {exc}")
            continue
        for words in simple:
            if command.inline and words and words[0] in BARE - {"python", "python3", "pytest", "deepspeed", "torchrun"}:
                continue
            if command.inline and len(words) == 1:
                continue  # prose naming a program (`.venv/bin/python`), not a command
            if command.inline and any(PLACEHOLDER.match(w) for w in words):
                words = [w for w in words if not PLACEHOLDER.match(w)]  # prose may name a placeholder inline
            found += [f"{command}: {p}" for p in command_problems(words)]
    assert found == []


def test_the_checker_catches_each_kind_of_broken_command():
    """The checks above are not vacuous: each kind of mistake they exist for is caught."""
    assert command_problems(["python", "-m", "nshard.study"])
    assert command_problems([".venv/bin/python", "-m", "nshard.study", "--plan", "launch/plans/cpu-study.toml",
                             "--no_such_flag"]) == ["python -m nshard.study takes no --no_such_flag"]
    assert command_problems([".venv/bin/python", "-m", "nshard.no_such_tool"]) == ["no module nshard.no_such_tool"]
    assert command_problems([".venv/bin/python", "-m", "nshard.study", "--plan", "launch/plans/none.toml"]) == [
        "no launch/plans/none.toml in the repository"]
    assert command_problems([".venv/bin/deepspeed", "--num_gpus", "1", "nshard/train.py", "--ds_config",
                             "ds_configs/dense.json", "--bogus"]) == ["nshard/train.py takes no --bogus"]
    assert command_problems([".venv/bin/deepspeed", "--no_such_launcher_flag", "nshard/train.py"])
    assert command_problems(["bash", "launch/demo.sh", "--no-such-option"])
    assert command_problems([".venv/bin/nshard-hosts", "check", "--hostfile", "hostfile", "--out", "runs/x",
                             "--plan", "PLAN"]) == ["'PLAN' looks like a placeholder: write a concrete example"]
    assert command_problems([".venv/bin/python", "-m", "nshard.hosts", "check", "--hostfile", "hostfile", "--out",
                             "runs/x", "--plan", "launch/plans/study.toml"]) == []
    assert simple_commands("A=1 bash launch/setup.sh && .venv/bin/python -m pytest -q 2>/dev/null | tail -1") == [
        ["A=1", "bash", "launch/setup.sh"], [".venv/bin/python", "-m", "pytest", "-q"], ["tail", "-1"]]
