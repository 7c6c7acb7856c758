"""The command line: both spellings of every flag of every tool, DeepSpeed's config flags, plan overrides (--set)
reaching the run's plan copy and identity, and the console scripts."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nshard import cli
from nshard.files import file_sha256
from nshard.run.plan import PlanError, load_plan

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "launch/plans/tiny.toml"
DENSE = REPO / "ds_configs/dense.json"
NOT_YET = {"launch/gpu_check.py": "being rewritten by another change",
           "launch/bench_phases.py": "new, written by another change",
           "launch/gpu_reducers.py": "new, written by another change",
           "launch/bench_delta.py": "new, written by another change"}
"""Tools whose parsers were left to the changes that own them; each should move to nshard.cli and leave this list."""
SCRIPTS = {"nshard-train": "nshard.train", "nshard-study": "nshard.study.runner", "nshard-grow": "nshard.grow",
           "nshard-hosts": "nshard.hosts", "nshard-store": "nshard.evidence.store",
           "nshard-archive": "nshard.evidence.archive", "nshard-report": "nshard.analysis.report",
           "nshard-evaluate": "nshard.study.evaluate", "nshard-validate": "nshard.study.validate",
           "nshard-cohort": "nshard.study.cohort", "nshard-commit": "nshard.evidence.commit",
           "nshard-paired": "nshard.analysis.paired", "nshard-memory-model": "nshard.analysis.memory_model",
           "nshard-zero-table": "nshard.analysis.zero_table"}


def tool_modules() -> dict[str, str]:
    """path -> module name of every file in nshard/, analysis/ and launch/ that builds an argparse parser."""
    found = {}
    for path in sorted([*(REPO / "nshard").rglob("*.py"), *(REPO / "analysis").glob("*.py"),
                        *(REPO / "launch").glob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel == "nshard/cli.py" or rel in NOT_YET or "ArgumentParser(" not in path.read_text():
            continue
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[rel] = ".".join(["nshard", *parts] if parts[0] == "analysis" else parts)
    return found


def all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_the_tool_list_finds_the_tools():
    tools = tool_modules()
    assert {"nshard/train.py", "nshard/study/runner.py", "analysis/report.py", "launch/capacity.py"} <= set(tools)
    assert len(tools) >= 25


@pytest.mark.parametrize("rel", sorted(tool_modules()))
def test_every_tool_takes_both_spellings_of_each_flag_and_says_what_it_writes(rel):
    module = importlib.import_module(tool_modules()[rel])
    assert hasattr(module, "build_parser"), f"{rel}: expose build_parser() built on nshard.cli.ArgumentParser"
    parser = module.build_parser()
    assert isinstance(parser, cli.ArgumentParser), f"{rel}: build the parser with nshard.cli.ArgumentParser"
    for each in all_parsers(parser):
        for action in each._actions:
            for option in (o for o in action.option_strings if o.startswith("--")):
                body = option[2:]
                both = ["--" + body.replace("-", "_"), "--" + body.replace("_", "-")]
                assert set(both) <= set(action.option_strings), f"{rel}: {option} lacks {both}"
                underscored = [o for o in action.option_strings if o.startswith("--")]
                assert underscored[0] == both[0], f"{rel}: {action.option_strings}: DeepSpeed's spelling first"
    assert re.search(r"\bwrites\b", parser.format_help(), re.I), f"{rel}: --help must say what the tool writes"


def test_both_spellings_parse_to_the_same_arguments():
    from nshard.study.evaluate import build_parser as evaluate_parser
    from nshard.train import parse_args

    underscored = parse_args(["--ds_config", str(DENSE), "--no_replay", "--local_rank", "0", "--resolved_ds_config",
                              "x.json"])
    dashed = parse_args(["--ds-config", str(DENSE), "--no-replay", "--local-rank", "0", "--resolved-ds-config",
                         "x.json"])
    assert underscored == dashed and underscored.no_replay and underscored.local_rank == 0
    base = ["--run", "r", "--model", "m", "--label", "l", "--out", "o"]
    parser = evaluate_parser()
    one = parser.parse_args([*base, "--max-new-tokens", "4", "--batch-size", "2", "--seed-eval", "s"])
    other = parser.parse_args([*base, "--max_new_tokens", "4", "--batch_size", "2", "--seed_eval", "s"])
    assert one == other and (one.max_new_tokens, one.batch_size, one.seed_eval) == (4, 2, Path("s"))


def test_a_prefix_of_a_flag_is_not_taken(capsys):
    from nshard.study.evaluate import build_parser as evaluate_parser

    with pytest.raises(SystemExit) as exit_:
        evaluate_parser().parse_args(["--run", "r", "--model", "m", "--label", "l", "--out", "o", "--max", "4"])
    assert exit_.value.code == 2 and "unrecognized arguments: --max" in capsys.readouterr().err


def test_deepspeed_config_is_the_ds_config_and_two_different_files_are_one_error(capsys):
    from nshard.train import parse_args

    args = parse_args(["--deepspeed", "--deepspeed_config", str(DENSE)])
    assert args.ds_config == str(DENSE) and args.deepspeed
    # The same file named both ways (once relative to the working directory) is one ds_config.
    assert parse_args(["--ds_config", str(DENSE), "--deepspeed_config",
                       os.path.relpath(DENSE)]).ds_config == str(DENSE)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--ds_config", str(DENSE), "--deepspeed_config", str(REPO / "ds_configs/powersgd.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "two different ds_configs: give one of them" in err and "powersgd.json" in err
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--plan", str(TINY)])
    assert exit_.value.code == 2 and "--deepspeed_config" in capsys.readouterr().err


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NSHARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_override_makes_a_plan_file_of_its_own_with_another_identity(cache):
    path = cli.plan_with_overrides(TINY, ["train.updates=8", "model.spec=tiny", "data.families=['lookup', 'sorting']"])
    assert path.parent == cache / "plans" and path != TINY
    plan, base = load_plan(path), load_plan(TINY)
    assert plan.train.updates == 8 and base.train.updates != 8
    assert plan.data.families == ("lookup", "sorting") and plan.name == base.name == "tiny"
    assert plan.model == base.model and plan.data.replay_file == base.data.replay_file
    assert file_sha256(path) != file_sha256(TINY) and "--set train.updates=8" in path.read_text()
    # Every rank writes the same bytes to the same name: one identity across ranks and reruns.
    assert cli.plan_with_overrides(TINY, ["train.updates=8", "model.spec=tiny",
                                          "data.families=['lookup', 'sorting']"]) == path
    assert file_sha256(cli.plan_with_overrides(TINY, ["train.updates=7"])) != file_sha256(path)
    assert cli.plan_with_overrides(TINY, []) == TINY  # no override: the plan file itself, as before


@pytest.mark.parametrize("override, message", [
    ("train.updaets=8", "unknown plan key train.updaets: known keys are"),
    ("trian.updates=8", "unknown plan section or key 'trian'"),
    ('train.updates="8"', "train.updates must be int, got str '8'"),
    ("train.updates=8x", "train.updates must be int, got str '8x'"),
    ("train.updates=0", "train.updates=0 must be positive"),
    ("train.updates", "write SECTION.KEY=VALUE"),
    ("train.a.b=1", "write SECTION.KEY=VALUE"),
])
def test_a_bad_override_is_one_error_naming_the_key(cache, override, message):
    with pytest.raises(PlanError) as error:
        cli.plan_with_overrides(TINY, [override])
    assert message in str(error.value)
    assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())  # nothing written for it


def test_train_takes_the_override_into_what_it_hands_deepspeed(cache, tmp_path, capsys):
    """nshard/train.py with --set: the plan the run reads is the overridden one (here, its batch keys), and an
    unknown key stops it with exit 2 before anything is built."""
    from nshard import train

    env = dict(os.environ)
    try:
        out = tmp_path / "resolved.json"
        assert train.main(["--ds_config", str(DENSE), "--plan", str(TINY), "--set", "train.global_batch_docs=4",
                           "--set", "train.microbatch_docs=1", "--resolved_ds_config", str(out)]) == 0
        resolved = json.loads(out.read_text())
        assert (resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"],
                resolved["train_batch_size"]) == (1, 4, 4)
        assert "nshard" not in resolved and "auto" not in json.dumps(resolved)
        assert train.main(["--ds_config", str(DENSE), "--plan", str(TINY), "--set", "train.updaets=8"]) == 2
        assert "nshard: error: unknown plan key train.updaets" in capsys.readouterr().err
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_the_run_directory_copies_the_overridden_plan_and_records_its_hash(cache, tmp_path):
    from nshard.run.training import Run, setup_run_dir

    path = cli.plan_with_overrides(TINY, ["train.updates=5"])
    run = Run(load_plan(path), path, DENSE, json.loads(DENSE.read_text()), tmp_path / "run", 0, 1)
    setup_run_dir(run, overwrite=False)
    assert (tmp_path / "run/plan.toml").read_bytes() == path.read_bytes()
    recorded = json.loads((tmp_path / "run/run.json").read_text())
    assert recorded["plan_sha256"] == file_sha256(path) != file_sha256(TINY) and recorded["updates"] == 5
    assert load_plan(tmp_path / "run/plan.toml") == load_plan(path)


def test_paths_found_beside_the_plan_are_found_from_the_overridden_copy(cache, tmp_path, monkeypatch):
    folder = tmp_path / "plans"
    (folder / "data").mkdir(parents=True)
    (folder / "data/replay.jsonl").write_text("")
    text = TINY.read_text().replace('replay_file = "launch/data/replay_general.jsonl"',
                                    'replay_file = "data/replay.jsonl"').replace('name = "tiny"\n', "")
    assert text != TINY.read_text()
    (folder / "mine.toml").write_text(text)
    monkeypatch.chdir(tmp_path)  # data/replay.jsonl is not found from here, only beside the plan
    original = load_plan(folder / "mine.toml")
    copy = load_plan(cli.plan_with_overrides(folder / "mine.toml", ["train.updates=2"]))
    assert copy.data.replay_file == original.data.replay_file == str(folder / "data/replay.jsonl")
    assert copy.name == "mine"  # the file's name, kept although the copy has another


def test_every_shipped_plan_survives_the_toml_writer():
    for path in sorted((REPO / "launch/plans").glob("*.toml")):
        raw = tomllib.loads(path.read_text())
        assert tomllib.loads(cli.toml_text(raw)) == raw, path.name


def test_the_toml_writer_keeps_awkward_values():
    raw = {"name": "x", "s": {"text": 'a "quoted" \\ back\nslash\t\x01\x7f é', "f": 1e-05, "big": 1e300,
                              "inf": math.inf, "neg": -2.5, "i": -3, "b": False, "list": [1, 2], "empty": [],
                              "inline": {"k": "v"}, "odd key": 1,
                              "arms": [{"name": "a", "ranks": 1}, {"name": "b", "replay": False}]}}
    assert tomllib.loads(cli.toml_text(raw)) == raw


def test_the_console_scripts_are_declared_installed_and_answer_help():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {name: target.split(":")[0] for name, target in declared.items()} == SCRIPTS
    for name, target in declared.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
        script = Path(sys.executable).with_name(name)  # what pip wrote: reinstall (launch/setup.sh) if missing
        assert script.is_file() and f"from {module} import {function}" in script.read_text(), \
            f"{script}: run .venv/bin/pip install -e . (launch/setup.sh does)"
    for name in ("nshard-train", "nshard-store"):  # the scripts themselves (the others import torch: seconds each)
        proc = subprocess.run([str(Path(sys.executable).with_name(name)), "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {name} "), proc.stderr


@pytest.mark.slow
def test_a_launched_run_records_its_override(tmp_path):
    import runs

    out = tmp_path / "run"
    runs.launch(out, DENSE, world=1, plan=TINY, extra_args=["--set", "train.updates=2"])
    copy = out / "plan.toml"
    assert load_plan(copy).train.updates == 2 != load_plan(TINY).train.updates
    assert json.loads((out / "run.json").read_text())["plan_sha256"] == file_sha256(copy) != file_sha256(TINY)
    assert [json.loads(line)["update"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_cli_module_loads_the_standard_library_only():
    """analysis/ tools build their parsers with it, and analysis/ imports neither torch nor the trainer."""
    code = ("import sys, nshard.cli; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'numpy', 'deepspeed', 'transformers') or m.startswith('nshard.') and m != 'nshard.cli'); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_resume_with_overwrite_is_refused_in_one_line_that_says_what_to_type_instead(tmp_path):
    """`--resume` added to a command that had `--overwrite` (as launch/demo.sh's did): one line naming the
    directory and what to type instead, exit 2, and nothing written."""
    from runs import run_env

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "nshard/train.py"), "--ds_config", str(DENSE), "--plan", str(TINY),
                           "--out", str(out), "--overwrite", "--resume"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=run_env())
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nshard:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert str(out) in errors[0] and "the same command without --overwrite" in errors[0]
    assert "bash launch/demo.sh ds_configs/powersgd.json --resume" in errors[0]
    assert not out.exists()


def test_demo_sh_takes_a_ds_config_and_resume_and_refuses_anything_else():
    proc = subprocess.run(["bash", str(REPO / "launch/demo.sh"), "ds_configs/dense.json", "--overwrite"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "launch/demo.sh: unknown option --overwrite (it takes a ds_config and --resume)"
