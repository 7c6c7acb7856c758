"""Bad input gets one clear error naming the problem, a non-zero exit, and no run directory."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from nshard.run.data import prepare
from nshard.run.models import load_tokenizer, resolve_model
from nshard.run.plan import PlanError, load_plan, plan_from_dict
from nshard.run.replay import replay_documents
from runs import REPO, run_env

TINY = (REPO / "launch/plans/tiny.toml").read_text()


def train_cli(tmp_path, plan_text, ds_config="ds_configs/dense.json"):
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "nshard/train.py", "--ds_config", str(ds_config), "--plan", str(plan),
                           "--out", str(out)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert not out.exists(), "a rejected run left a run directory behind"
    errors = [l for l in proc.stderr.splitlines() if l.startswith("nshard: error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return errors[0]


def test_unknown_plan_key(tmp_path):
    msg = train_cli(tmp_path, TINY.replace("[train]", "[train]\nlearning_rate = 3"))
    assert "train.learning_rate" in msg


def test_negative_batch_size(tmp_path):
    msg = train_cli(tmp_path, TINY.replace("global_batch_docs = 6", "global_batch_docs = -6"))
    assert "train.global_batch_docs" in msg and "positive" in msg


def test_missing_model_path(tmp_path):
    msg = train_cli(tmp_path, TINY.replace('spec = "tiny"', f'spec = "{tmp_path}/no-such-model"'))
    assert "no-such-model" in msg and "does not exist" in msg


def test_conversation_without_assistant_turn(tmp_path):
    bad = tmp_path / "replay.jsonl"
    lines = (REPO / "launch/data/replay_general.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"messages": [{"role": "user", "content": "hello?"}]})
    bad.write_text("\n".join(lines) + "\n")
    msg = train_cli(tmp_path, TINY.replace('"launch/data/replay_general.jsonl"', f'"{bad}"'))
    assert f"{bad}:3" in msg and "no assistant turn" in msg


CHAT = (REPO / "launch/plans/tiny-chat.toml").read_text()


def chat_lines(edit_line: int, line: str) -> list[str]:
    lines = (REPO / "launch/data/chat_train.jsonl").read_text().splitlines()
    lines[edit_line - 1] = line
    return lines


@pytest.mark.parametrize("suffix, line, fragments", [
    (".jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}),
     [":3: messages[1] must have exactly the keys 'role' and 'content'"]),
    (".jsonl", '{"messages": [{"role": "user", "content": "hi"}', [":3: not valid JSON"]),
    (".parquet", json.dumps({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
     [" row 3: messages[0].role='robot'"]),
    (".parquet", json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                             "weight": -1.0}), [" row 3: field 'weight' must be a positive number"]),
])
def test_a_malformed_chat_row_is_refused_naming_the_file_line_and_field(tmp_path, suffix, line, fragments):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(chat_lines(3, line)) + "\n")
    path = jsonl
    if suffix == ".parquet":  # the same rows written by datasets
        import datasets

        path = tmp_path / "train.parquet"
        datasets.load_dataset("json", data_files=str(jsonl), split="train",
                              cache_dir=str(tmp_path / "hf")).to_parquet(str(path))
    msg = train_cli(tmp_path, CHAT.replace('"launch/data/chat_train.jsonl"', f'"{path}"'))
    assert str(path) in msg and all(f in msg for f in fragments), msg


def test_bad_ds_config(tmp_path):
    cfg = json.loads((REPO / "ds_configs/dense.json").read_text())
    cfg["nshard"] = {"reducer": "powersgd", "rank": 0}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert "nshard.rank" in train_cli(tmp_path, TINY, ds_config=path)


def test_hostfile_line_that_does_not_parse(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\nworker-1 slots two\n")
    proc = subprocess.run(["bash", "launch/run.sh", "--hostfile", str(hostfile), "--",
                           "--ds_config", "ds_configs/dense.json"], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"{hostfile}:2" in proc.stderr and "HOST slots=N" in proc.stderr


@pytest.mark.parametrize("bad,key", [({"name": 3}, "name"),
                                     ({"data": {"families": ["lookup", "poetry"]}}, "data.families"),
                                     ({"data": {"seed": 1, "eval_seed": 1}}, "data.eval_seed"),
                                     ({"train": {"microbatch_docs": 1.5}}, "train.microbatch_docs"),
                                     ({"data": {"retention_docs": 9, "replay_docs": 8}}, "data.retention_docs"),
                                     ({"study": {"placement": "remote"}}, "study.placement"),
                                     ({"study": {"link": "fast"}}, "study.link"),
                                     ({"study": {"cores_per_host": 0}}, "study.cores_per_host"),
                                     ({"study": {"placement": "emulated", "hostfile": "h"}}, "study.hostfile"),
                                     ({"study": {"validate_regenerate": 1}}, "study.validate_regenerate"),
                                     ({"study": {"validate_regenerate_batches": 1}},
                                      "study.validate_regenerate_batches"),
                                     ({"study": {"arms": [{"name": "a", "keep_state": "yes"}], "candidate": "a",
                                                 "speed_baseline": "a"}}, "study.arms[0].keep_state"),
                                     ({"data": {"chat_train": "mine.jsonl"}}, "data.chat_heldout"),
                                     ({"data": {"families": []}}, "data.families"),
                                     ({"study": {"store": "s3://Bad_Bucket/p"}}, "study.store"),
                                     ({"study": {"store": "ftp://host/dir"}}, "study.store")])
def test_plan_validation_names_the_key(bad, key):
    with pytest.raises(PlanError) as err:
        plan_from_dict(bad)
    # The full dotted key as a word of its own: "name" inside "model.name" or "filename" does not count.
    assert re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", str(err.value)), str(err.value)


def test_a_study_store_directory_is_resolved_like_the_plans_other_paths(tmp_path, monkeypatch):
    plans = tmp_path / "repo" / "launch" / "plans"
    plans.mkdir(parents=True)
    (tmp_path / "repo" / "stores" / "main").mkdir(parents=True)
    plan = plans / "p.toml"
    monkeypatch.chdir(tmp_path)
    for store, expected in [("stores/main", tmp_path / "repo" / "stores" / "main"),  # found above the plan
                            ("new-store", tmp_path / "new-store"),  # none yet: from the working directory
                            ("s3://nshard-bucket/studies", "s3://nshard-bucket/studies")]:
        plan.write_text(f'[study]\nstore = "{store}"\n')
        assert load_plan(plan).study.store == str(expected)
    (tmp_path / "a-file").write_text("")
    plan.write_text('[study]\nstore = "a-file"\n')
    with pytest.raises(PlanError, match="study.store='a-file': .* is not a directory"):
        load_plan(plan)


def test_prepared_identity_is_stable_and_follows_the_seed():
    plan = load_plan(REPO / "launch/plans/tiny.toml")
    tok = load_tokenizer(resolve_model(plan.model.spec))
    ident = lambda p: prepare(p, tok, replay_documents(p, None, tok))[-1]
    first = ident(plan)
    assert first == ident(load_plan(REPO / "launch/plans/tiny.toml"))
    reseeded = dataclasses.replace(plan, data=dataclasses.replace(plan.data, seed=plan.data.seed + 1))
    assert ident(reseeded) != first


def test_response_tokens_carry_the_weight_and_prompts_none():
    plan = load_plan(REPO / "launch/plans/tiny.toml")
    tok = load_tokenizer(resolve_model(plan.model.spec))
    docs, prepared, *_ = prepare(plan, tok, replay_documents(plan, None, tok))
    doc, p = docs[0], prepared[0]
    answer_ids = [i for i, w in zip(p.input_ids, p.weights) if w]
    assert tok.decode(answer_ids) == doc.messages[-1]["content"] + "<|im_end|>"
    assert p.weights[-1] == 0.0  # the template's newline after <|im_end|> is not trained


@pytest.mark.parametrize("cohort, fragment", [
    ('start = "optimizer"', 'cohort.start=\'optimizer\': use "state"'),
    ('start = "weights"\ndense_warmup = true', "cohort.dense_warmup = true needs cohort.start"),
    ("first_cohort_share = 1.5", "cohort.first_cohort_share=1.5 must lie in [0, 1]"),
    ("first_cohort_eval_cases_per_family = -1", "cohort.first_cohort_eval_cases_per_family=-1"),
    ("form = 'runs/x'", "unknown plan key cohort.form: known keys are dense_warmup, first_cohort_eval_cases_per_family, "
                        "first_cohort_response_weight, first_cohort_share, from, replay_cases, screen_min_accuracy, "
                        "start"),
])
def test_a_bad_cohort_section_names_the_key(tmp_path, cohort, fragment):
    msg = train_cli(tmp_path, TINY + f"\n[cohort]\n{cohort}\n")
    assert fragment in msg, msg


def test_a_cohort_from_a_directory_that_is_no_study_is_refused(tmp_path):
    msg = train_cli(tmp_path, TINY + f'\n[cohort]\nfrom = "{tmp_path}"\n')
    assert "is not a study directory (no study.json)" in msg


def test_a_cohort_plan_without_arms_trains_the_candidate_and_a_no_replay_control():
    plan = plan_from_dict({"cohort": {"from": "/studies/first"}})
    assert [(a.name, a.ranks, a.replay) for a in plan.study.arms] == [("powersgd", 2, True), ("no-replay", 2, False)]
    assert plan.study.candidate == plan.study.speed_baseline == "powersgd"
    assert [a.name for a in plan_from_dict({}).study.arms] == ["one-rank", "dense", "powersgd"]


def test_the_cohort_plan_loads_with_its_study_found_from_the_checkout():
    plan = load_plan(REPO / "launch/plans/cpu-cohort.toml")
    assert plan.cohort.enabled and plan.cohort.start == "state" and plan.cohort.replay_cases == {"lookup": 48}
    assert plan.data.families == ("cheapest", "acronym") and plan.cohort.from_study.endswith("runs/cpu-study")
    assert [(a.name, a.replay, a.interpolate) for a in plan.study.arms] == [
        ("powersgd", True, ""), ("interpolated", True, "powersgd"), ("no-replay", False, ""),
        ("no-replay-interpolated", True, "no-replay")]
    assert plan.study.candidate == "interpolated" and plan.data.heldout_retention_docs == 64
    assert not load_plan(REPO / "launch/plans/tiny.toml").cohort.enabled


def test_bf16_auto_resolves_on_this_machine_and_a_bad_value_names_the_key():
    """"bf16": {"enabled": "auto"} (the CPU ds_configs) is bf16 where the machine has bf16 matrix units that torch
    uses, fp32 elsewhere, and DeepSpeed is handed a bool; any other value is refused naming the key."""
    from nshard.run.plan import load_plan
    from nshard.seam.ds_config import (DsConfigError, bf16_units, complete_ds_config, load_ds_config, precision,
                                       validate_ds_config)

    config = load_ds_config(REPO / "ds_configs/cpu-powersgd.json")
    assert config["bf16"] == {"enabled": "auto"}
    units, why = bf16_units()
    done = complete_ds_config(config, load_plan(REPO / "launch/plans/tiny.toml"), 2)
    assert done["bf16"]["enabled"] is units
    assert precision(config) == {"requested": "auto", "compute": "bfloat16" if units else "float32",
                                 "masters": "float32", "why": why}
    with pytest.raises(DsConfigError, match=r"bf16\.enabled='yes': use true, false or \"auto\""):
        validate_ds_config({**config, "bf16": {"enabled": "yes"}})


def test_bf16_auto_is_fp32_where_torch_runs_no_avx512_kernels():
    """On a CPU without bf16 units (here: torch told to take its AVX2 kernels) "auto" trains in fp32, and says why."""
    code = ("from nshard.seam.ds_config import bf16_units, precision; import json; "
            "print(json.dumps([bf16_units(), precision({'bf16': {'enabled': 'auto'}})]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                          capture_output=True, text=True, check=True)
    (units, why), record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert units is False and record["compute"] == "float32" and record["why"] == why


@pytest.mark.parametrize("key, value, fragment", [
    ("amsgrad", True, "optimizer.params.amsgrad=true: nshard steps AdamW with lr, betas, eps, weight_decay only"),
    ("foreach", False, "optimizer.params.foreach=false: "),
    ("max_grad_norm", 1.0, "clip with the top-level \"gradient_clipping\" key instead"),
    ("adam_w_mode", False, "optimizer.params.adam_w_mode=false: nshard steps AdamW"),
])
def test_an_optimizer_param_nshard_would_not_apply_is_refused_naming_the_key(key, value, fragment):
    """torch's AdamW is built from lr, betas, eps and weight_decay: any other optimizer param is refused naming the
    key and the fix, when the ds_config is read and again where the optimizer is built, never dropped without a word.
    "Adam" runs the same AdamW, and adam_w_mode is accepted as true only."""
    import torch

    from nshard.seam.ds_config import DsConfigError, validate_ds_config
    from nshard.seam.engine import torch_adamw

    config = json.loads((REPO / "ds_configs/dense.json").read_text())
    validate_ds_config(config)  # the shipped params: lr, betas, eps, weight_decay, torch_adam
    adam = json.loads(json.dumps(config))
    adam["optimizer"]["type"] = "Adam"
    adam["optimizer"]["params"]["adam_w_mode"] = True
    validate_ds_config(adam)
    assert type(torch_adamw([torch.nn.Parameter(torch.zeros(2))], adam)) is torch.optim.AdamW
    config["optimizer"]["params"][key] = value
    for check in (validate_ds_config, lambda c: torch_adamw([torch.nn.Parameter(torch.zeros(2))], c)):
        with pytest.raises(DsConfigError) as refused:
            check(config)
        message = str(refused.value)
        assert message.startswith(f"optimizer.params.{key}=") and fragment in message, message


def test_the_gpu_recipe_runs_as_shipped_with_only_files_the_project_provides(monkeypatch):
    """launch/plans/study.toml: every file it names is in the checkout (replay: the seed model's own answers to
    the built-in prompts), each multi-rank arm's ranks equal its hostfile's slots, and every arm's ds_config passes
    the trainer's own checks on a GPU (the hub model itself is fetched at run time)."""
    from nshard.run.hostfile import parse_hostfile
    from nshard.run.replay import check_replay_source
    from nshard.seam.ds_config import check_optimizer_path, complete_ds_config, load_ds_config, reducer_config
    from nshard.study.runner import resolve_ds_config

    monkeypatch.chdir(REPO.parent)  # from outside the checkout: nothing may be found by accident of the cwd
    path = REPO / "launch/plans/study.toml"
    plan = load_plan(path)
    assert plan.data.replay_file == "" and plan.data.replay_docs > 0
    check_replay_source(plan)
    slots = sum(parse_hostfile(plan.study.hostfile).values())
    for arm in plan.study.arms:
        config = load_ds_config(resolve_ds_config(arm.ds_config, path))
        reducer_config(config)
        check_optimizer_path(config, cuda=True)
        complete_ds_config(config, plan, arm.ranks)
        assert arm.ranks == 1 or arm.ranks == slots, f"arm {arm.name}: {arm.ranks} ranks, hostfile {slots} slots"


def test_a_study_lands_where_a_second_cohort_looks_for_it(monkeypatch):
    """`python -m nshard.study --plan launch/plans/cpu-study.toml` and launch/study.sh write runs/cpu-study, the
    directory launch/plans/cpu-cohort.toml's cohort.from names."""
    from nshard.study.runner import default_out

    monkeypatch.chdir(REPO)
    first = default_out(load_plan(REPO / "launch/plans/cpu-study.toml")).resolve()
    assert str(first) == load_plan(REPO / "launch/plans/cpu-cohort.toml").cohort.from_study
    assert first == (REPO / "runs" / "cpu-study").resolve()


def test_the_preflight_refuses_a_deepspeed_env_line_the_launcher_would_stop_on(tmp_path):
    """A blank line in .deepspeed_env makes DeepSpeed's launcher fail on `key, val = line.split('=', 1)`: the
    preflight names the file and line instead (exit 2, one line)."""
    (tmp_path / "hostfile").write_text("gpu-a slots=1\n")
    (tmp_path / "env").write_text("GLOO_SOCKET_IFNAME=eth0\n\n")
    proc = subprocess.run([sys.executable, "-m", "nshard.hosts", "check", "--hostfile", str(tmp_path / "hostfile"),
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**run_env(), "DS_ENV_FILE": str(tmp_path / "env")})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"nshard: error: {tmp_path / 'env'}:2: '' is not KEY=VALUE; DeepSpeed's launcher stops on such a line "
        "(blank lines included): remove it"]


def test_the_preflight_says_when_gloo_would_talk_on_loopback():
    from nshard.hosts import interface_problems

    facts = {"env": {"GLOO_SOCKET_IFNAME": None, "NCCL_SOCKET_IFNAME": "=ib0"}, "interfaces": ["eth0", "ib0", "lo"],
             "hostname": "gpu-a", "hostname_address": "127.0.1.1"}
    assert [p.split(":")[1].strip() for p in interface_problems("gpu-a", facts, {})] == [
        "GLOO_SOCKET_IFNAME is unset and its hostname gpu-a resolves to 127.0.1.1, so gloo (nshard's long-wait group, "
        "CPU runs) would use loopback"]
    assert interface_problems("gpu-a", facts, {"GLOO_SOCKET_IFNAME": "eth0"}) == []
    assert interface_problems("gpu-a", {**facts, "env": {"NCCL_SOCKET_IFNAME": "eth"}}, {"GLOO_SOCKET_IFNAME": "eth0"}) == []


def _host_facts(**changes) -> dict:
    facts = {"commit": "c" * 40, "changes": "d", "versions": {"torch": "2.13.0", "deepspeed": "0.19.8",
                                                                "transformers": "5.24"},
             "python": "/x/.venv/bin/python", "gpus": 8, "read": "tok", "wrote": True, "cwd_exists": True,
             "files": {"plan": "a" * 64, "data.chat_train": "b" * 64},
             "cache": {"NSHARD_CACHE": "/shared/cache", "shared": True}}
    facts.update(changes)
    return facts


def _here() -> dict:
    here = _host_facts()
    here.update(checkout="/x", cwd="/x", wanted={"files": {"plan": "/shared/plan.toml",
                                                           "data.chat_train": "/shared/chat.jsonl"},
                                                 "hub_model": "org/model"})
    return here


def test_the_preflight_takes_more_gpus_than_slots_and_says_which_the_ranks_use():
    from nshard.hosts import compare, devices_used

    assert compare("gpu-a", 2, _host_facts(gpus=8), _here(), "cuda", "/out", "tok") == []
    assert devices_used("gpu-a", 2, 8) == ("; ranks on GPU 0,1 of its 8 (DeepSpeed's launcher takes the first 2; to use "
                                           "others, launch with --include gpu-a:6,7)")
    assert devices_used("gpu-a", 2, 2) == "; ranks on GPU 0,1"
    short = compare("gpu-a", 2, _host_facts(gpus=1), _here(), "cuda", "/out", "tok")
    assert short == ["gpu-a: sees 1 GPU(s) for slots=2: set slots=1 in the hostfile, or make that many GPUs visible "
                     "there"]


def test_the_preflight_names_a_data_file_missing_or_different_on_a_host_and_a_cache_it_does_not_share():
    from nshard.hosts import compare

    facts = _host_facts(files={"plan": "a" * 64, "data.chat_train": None},
                        cache={"NSHARD_CACHE": "/home/u/.cache/nshard", "shared": False}, cwd_exists=False,
                        hub={"HF_HOME": "/home/u/.cache/huggingface", "cached": False, "shared": False})
    problems = compare("gpu-b", 1, facts, _here(), "cpu", "/out", "tok")
    assert [p.split(":")[1].strip().split(" ")[0] for p in problems] == ["has", "data.chat_train", "NSHARD_CACHE",
                                                                        "org/model"], problems
    assert "data.chat_train /shared/chat.jsonl is missing there: every rank reads it itself" in problems[1]
    assert "NSHARD_CACHE (/home/u/.cache/nshard as its ranks see it) is not the launching machine's cache " \
           "/shared/cache" in problems[2]
    assert "snapshot_download('org/model')" in problems[3]
    other = compare("gpu-b", 1, _host_facts(files={"plan": "a" * 64, "data.chat_train": "e" * 64}), _here(), "cpu",
                    "/out", "tok")
    assert other == ["gpu-b: data.chat_train /shared/chat.jsonl differs from the launching machine's (sha256 "
                     "eeeeeeeeeeee there, bbbbbbbbbbbb here): copy the same file there"]
    cached = _host_facts(hub={"HF_HOME": "/h", "cached": True, "shared": False})
    assert compare("gpu-b", 1, cached, _here(), "cpu", "/out", "tok") == []


def test_the_preflight_wants_this_shells_cache_variables_to_match_the_ranks(monkeypatch):
    from nshard.hosts import cache_problems

    monkeypatch.delenv("NSHARD_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", "/shared/hf")
    problems = cache_problems({"NSHARD_CACHE": "/shared/cache", "HF_HOME": "/shared/hf"})
    assert problems == ["this machine: .deepspeed_env sets NSHARD_CACHE=/shared/cache for the ranks, but this shell has "
                        "NSHARD_CACHE=(unset); the study process and its one-rank arm read this shell, so the first "
                        "timed arm would fill the ranks' cache: export NSHARD_CACHE=/shared/cache here too"]
    monkeypatch.setenv("NSHARD_CACHE", "/shared/cache")
    assert cache_problems({"NSHARD_CACHE": "/shared/cache"}) == []


def test_the_preflight_checks_the_plan_and_resolves_its_files_as_a_run_does(tmp_path, monkeypatch):
    from nshard.hosts import main, plan_inputs

    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "heldout.jsonl"):
        (data / name).write_text("{}\n")
    plan = tmp_path / "plans" / "mine.toml"
    plan.parent.mkdir()
    plan.write_text('name = "mine"\n[model]\nspec = "org/model"\n[data]\nfamilies = []\n'
                    'chat_train = "data/train.jsonl"\nchat_heldout = "data/heldout.jsonl"\n')
    monkeypatch.chdir(tmp_path / "plans")  # found in the folder above the plan's, as a run finds it
    wanted = plan_inputs(str(plan))
    assert wanted == {"files": {"plan": str(plan), "data.chat_train": str(data / "train.jsonl"),
                                "data.chat_heldout": str(data / "heldout.jsonl")}, "hub_model": "org/model"}
    plan.write_text(plan.read_text().replace("heldout.jsonl", "gone.jsonl"))
    with pytest.raises(FileNotFoundError, match="data.chat_heldout=data/gone.jsonl does not exist here"):
        plan_inputs(str(plan))
    plan.write_text('name = "mine"\n[train]\nupdaets = 3\n')
    (tmp_path / "hostfile").write_text("gpu-a slots=1\n")
    assert main(["check", "--hostfile", str(tmp_path / "hostfile"), "--out", str(tmp_path / "out"), "--plan",
                 str(plan)]) == 2


def test_a_study_says_each_paired_screens_declared_power_before_scoring(tmp_path, capsys):
    """screens.expected_discordance declares the paired screens' power: before any case is scored the study prints
    the probability that an equal candidate passes at the cases its prepared sets name, and warns below 80%."""
    from nshard.run.plan import plan_from_dict
    from nshard.study.runner import say_declared_power

    with pytest.raises(PlanError, match="screens.expected_discordance=1.5 must lie in"):
        plan_from_dict({"screens": {"expected_discordance": 1.5}})
    plan = plan_from_dict({"name": "p", "screens": {"expected_discordance": 0.05},
                           "study": {"candidate": "powersgd", "arms": [
                               {"name": "one-rank"}, {"name": "powersgd", "ranks": 2}]}})
    run = tmp_path / "powersgd"
    (run / "prepared").mkdir(parents=True)
    (run / "prepared" / "sets.json").write_text(json.dumps({"eval_case_ids": [f"c{i}" for i in range(64)]}))
    powers = say_declared_power(plan, {"powersgd": run, "one-rank": tmp_path / "one-rank"})
    assert [p["screen"] for p in powers] == ["paired lower bound vs one-rank"] and powers[0]["n"] == 64
    out, err = capsys.readouterr()
    assert "declared power: paired lower bound vs one-rank (n = 64, expected discordance 5.00%)" in out
    assert "nshard: warning: paired lower bound vs one-rank" in err and "underpowered" in err


def test_a_growth_study_declares_the_power_of_its_first_cohort_screen_and_not_of_its_advantage_screen(tmp_path, capsys):
    """A growth study's first-cohort screen is a parity screen against the accepted checkpoint, so its power is
    printed before scoring; grown against continued dense asks for an advantage, where an equal candidate should
    fail, so no parity power is printed for it."""
    from nshard.run.plan import plan_from_dict
    from nshard.study.runner import say_declared_power

    plan = plan_from_dict({"name": "g", "growth": {"budget": "train_flops", "top_k": 1},
                           "cohort": {"from": str(tmp_path / "accepted"), "start": "weights"},
                           "screens": {"expected_discordance": 0.15},
                           "study": {"candidate": "grown", "speed_baseline": "dense", "arms": [
                               {"name": "dense", "ranks": 2}, {"name": "grown", "ranks": 2, "grown": True}]}})
    run = tmp_path / "grown"
    (run / "prepared").mkdir(parents=True)
    (run / "prepared" / "sets.json").write_text(json.dumps({
        "eval_case_ids": [f"c{i}" for i in range(128)],
        "cohort": {"first_cohort_eval_case_ids": [f"f{i}" for i in range(96)]}}))
    powers = say_declared_power(plan, {"grown": run, "dense": tmp_path / "dense"})
    assert [(p["screen"], p["n"]) for p in powers] == [
        ("first-cohort paired lower bound vs the accepted checkpoint", 96)]
    out, err = capsys.readouterr()
    assert "declared power: first-cohort paired lower bound vs the accepted checkpoint (n = 96" in out
    assert "vs dense" not in out + err
