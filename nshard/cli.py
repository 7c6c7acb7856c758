"""The command line every nshard tool shares: both spellings of each long flag, DeepSpeed's config flags, and plan
overrides (`--set SECTION.KEY=VALUE`) written into a plan file of their own, which the run copies and hashes.

Flags are spelled DeepSpeed's way (`--ds_config`, `--max_new_tokens`); the dashed spelling (`--max-new-tokens`) is
the same option. Importing this module loads the standard library only (analysis/ tools use it without torch).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import sys
from pathlib import Path



def _toml():
    """tomllib (tomli before Python 3.11), imported where a plan is read: launch/hosts.sh and launch/setup.sh build
    nshard.cgroups' parser with whatever python3 the machine has, where tomli may be missing."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib

SPELLING_NOTE = "Every --flag_name is also accepted as --flag-name."


def prog(module: str) -> str:
    """The name a tool's usage line shows: its console script's (nshard-study) when run as one, else
    `python -m MODULE`."""
    name = Path(sys.argv[0]).name
    return name if name.startswith("nshard-") else f"python -m {module}"


def spellings(names) -> list[str]:
    """Option strings with each long one in both spellings, DeepSpeed's (underscores) first: argparse takes its dest
    and the usage line from the first."""
    out = []
    for name in names:
        if name.startswith("--") and len(name) > 2:
            body = name[2:]
            out += ["--" + body.replace("-", "_"), "--" + body.replace("_", "-")]
        else:
            out.append(name)
    return list(dict.fromkeys(out))


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Docstrings as written; an option's spellings share one metavar (`--max_new_tokens, --max-new-tokens N`)."""

    def _format_action_invocation(self, action):
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        args = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {args}"


def _both_spellings(container):
    add = container.add_argument
    container.add_argument = lambda *names, **kwargs: add(*spellings(names), **kwargs)
    return container


class ArgumentParser(argparse.ArgumentParser):
    """argparse with both spellings of every long option, in groups and subcommands too. Prefixes of a flag are
    not taken (allow_abbrev=False): with two spellings a prefix would be ambiguous, and a flag added later would
    silently change what an old prefix meant."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        _both_spellings(self)

    def add_argument_group(self, *args, **kwargs):
        return _both_spellings(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, *args, **kwargs):
        return _both_spellings(super().add_mutually_exclusive_group(*args, **kwargs))


# ---- DeepSpeed's config flags ---------------------------------------------------------------------------------

def add_ds_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--ds_config, and the flags deepspeed.add_config_arguments defines: --deepspeed_config (the same file) and
    --deepspeed (a switch user code may pass; nshard always runs under DeepSpeed)."""
    parser.add_argument("--ds_config", metavar="FILE",
                        help="DeepSpeed JSON: optimizer, schedule, precision, ZeRO, and an optional \"nshard\" section "
                             "(required; --deepspeed_config is the same flag)")
    parser.add_argument("--deepspeed_config", metavar="FILE", help="DeepSpeed's name for --ds_config")
    parser.add_argument("--deepspeed", action="store_true",
                        help="accepted as deepspeed.add_config_arguments defines it; changes nothing")


def ds_config_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The one ds_config the flags name; two different files, or none, is a usage error (exit 2)."""
    given = [p for p in (args.ds_config, args.deepspeed_config) if p]
    if not given:
        parser.error("give the ds_config: --ds_config FILE (or DeepSpeed's --deepspeed_config FILE)")
    if len(given) == 2 and Path(given[0]).resolve() != Path(given[1]).resolve():
        parser.error(f"--ds_config {given[0]} and --deepspeed_config {given[1]} name two different ds_configs: "
                     "give one of them")
    return given[0]


# ---- plan overrides ---------------------------------------------------------------------------------------------

SET_HELP = ("override one plan key, SECTION.KEY=VALUE (repeatable; e.g. --set train.updates=8). VALUE is a TOML "
            "value (8, 2e-4, true, \"text\", [\"a\", \"b\"]); one that is not valid TOML is taken as text, so "
            "--set model.spec=tiny works. The plan with its overrides is written to $NSHARD_CACHE/plans/ (default "
            "~/.cache/nshard/plans/) and used as the plan file: the run's plan.toml and plan_sha256 are that file's")

PATH_KEYS = (("data", "replay_file"), ("data", "chat_train"), ("data", "chat_heldout"), ("study", "hostfile"),
             ("study", "store"), ("cohort", "from"))
"""Plan keys that name files, found beside the plan when they are not found from the working directory
(nshard/run/plan.py load_plan; and each study.arms ds_config, nshard/study/runner.py resolve_ds_config)."""


def add_plan_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP)


def parse_override(text: str) -> tuple[list[str], object]:
    """'train.updates=8' -> (['train', 'updates'], 8)."""
    from nshard.run.plan import PlanError

    key, sep, value = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not 1 <= len(keys) <= 2 or not all(keys):
        raise PlanError(f"--set {text!r}: write SECTION.KEY=VALUE (or name=VALUE), e.g. --set train.updates=8")
    toml = _toml()
    try:
        parsed = toml.loads(f"value = {value}")
    except toml.TOMLDecodeError:
        parsed = {}
    return keys, parsed["value"] if list(parsed) == ["value"] else value


def apply_overrides(raw: dict, overrides) -> dict:
    """The plan's TOML table with each override set; the plan's own validation judges the result."""
    from nshard.run.plan import PlanError

    raw = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) == 1:
            raw[keys[0]] = value
            continue
        section = raw.setdefault(keys[0], {})
        if not isinstance(section, dict):
            raise PlanError(f"--set {text}: plan key {keys[0]!r} is not a [section] table")
        section[keys[1]] = value
    return raw


def plan_with_overrides(plan_path: str | Path, overrides) -> Path:
    """The plan file a run reads: `plan_path` itself without overrides; else the plan with them, validated as a
    plan file is, written once to NSHARD_CACHE/plans/<name>-<sha256 prefix>.toml (the same bytes, so the same path
    and identity, on every rank), with the paths it names pinned so that they resolve as they did beside the plan."""
    from nshard.files import cache_root, write_text_atomic
    from nshard.run.plan import PlanError, find_beside, load_plan, plan_from_dict

    plan_path = Path(plan_path)
    if not overrides:
        return plan_path
    if not plan_path.is_file():
        load_plan(plan_path)  # raises the error a missing plan gets without --set
    toml = _toml()
    try:
        raw = toml.loads(plan_path.read_text())
    except toml.TOMLDecodeError as exc:
        raise PlanError(f"plan file {plan_path} is not valid TOML: {exc}") from None
    raw = {"name": raw.get("name", plan_path.stem), **apply_overrides(raw, overrides)}
    try:
        plan_from_dict(raw, default_name=plan_path.stem)
    except PlanError as exc:
        raise PlanError(f"{exc} (plan {plan_path} with --set {' --set '.join(overrides)})") from None
    for section, key in PATH_KEYS:
        value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str):
            raw[section][key] = _pinned(value, plan_path, find_beside)
    for arm in raw.get("study", {}).get("arms", []) if isinstance(raw.get("study"), dict) else []:
        if isinstance(arm, dict) and isinstance(arm.get("ds_config"), str):
            arm["ds_config"] = _pinned(arm["ds_config"], plan_path, find_beside)
    text = (f"# {plan_path.name} with command-line overrides: {' '.join(f'--set {o}' for o in overrides)}\n"
            "# Written by nshard (nshard/cli.py); a run directory's plan.toml is a copy of this file.\n"
            + toml_text(raw))
    path = cache_root() / "plans" / f"{raw['name']}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.toml"
    if not path.is_file() or path.read_text() != text:
        write_text_atomic(path, text)
    load_plan(path)  # what the run will read: the same validation, from where it lies
    return path


def _pinned(value: str, plan_path: Path, find_beside) -> str:
    """A path found beside the plan becomes absolute (the combined plan lies elsewhere); any other stays as given."""
    found = find_beside(value, plan_path)
    return value if str(found) == value else str(Path(found).resolve())


# ---- TOML writing -----------------------------------------------------------------------------------------------

def toml_text(table: dict) -> str:
    """A plan's table as TOML (tomli_w: top-level keys, then one [section] each, its lists of tables as
    [[section.key]])."""
    import tomli_w

    return tomli_w.dumps(table)
