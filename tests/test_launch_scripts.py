"""Every figure-producing script under launch/ runs end to end on the tiny model, one round: seconds to a couple
of minutes each, so that a script whose figures the docs quote cannot rot unseen. launch/zero_stages.py's run is
in tests/test_zero_table.py; launch/gpu_check.py needs a GPU, and its dry run is in tests/test_gpu.py; the scripts that
bring up the emulated hosts (bench_link, bench_pooled, bench_duplex) are in tests/test_hosts.py, where those tests
take turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runs import REPO, run_env

if str(REPO) not in sys.path:  # launch/ is imported below, as tests/test_capacity.py does
    sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.slow
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, memory cgroups)")


def script(*args, timeout=900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_powersgd_runs_one_update_per_arm():
    proc = script("launch.bench_powersgd", "--models", "135m", "--layers", "1", "--updates", "1", "--rank", "4")
    assert "ratios: nshard/hook time" in proc.stdout


def test_bench_bf16_step_times_old_and_new_and_finds_them_bit_identical(tmp_path):
    """A one-layer slice of each model (the embedding frozen and the seconds scaled, as the 1.7B row is)."""
    out = tmp_path / "bf16-step.json"
    proc = script("launch.bench_bf16_step", "--models", "135m", "1.7b", "--layers_135m", "1", "--layers_1_7b", "1",
                  "--updates", "1", "--out", str(out))
    assert proc.stdout.count("BIT-IDENTICAL") == 2 and "| new |" in proc.stdout and "bf16 units:" in proc.stdout
    body = json.loads(out.read_text())
    for m in body["models"]:
        assert m["sliced"] and m["scale"] > 1 and m["bit_identical"]
        assert (m["ways"]["old"]["master_step"], m["ways"]["new"]["master_step"]) == ("per parameter", "flat")
        assert (m["ways"]["old"]["one_rank_skip"], m["ways"]["new"]["one_rank_skip"]) == (False, True)


def test_bench_microbatch_runs_two_sizes_on_the_tiny_plan():
    proc = script("launch.bench_microbatch", "--plan", "launch/plans/tiny.toml", "--sizes", "1", "2",
                  "--updates", "1", "--batch_docs", "2")
    assert "| microbatch | s/update (median) | tokens/s | ratio to microbatch 1 |" in proc.stdout


def test_kill_resume_runs_one_trial():
    proc = script("launch.kill_resume", "--trials", "1", "--stages", "0", "--updates", "2", "--every", "1")
    assert "matched 1/1" in proc.stdout


@root_only
def test_memory_probe_measures_one_arm_of_the_tiny_model(tmp_path):
    script("launch.memory_probe", "--model", "tiny", "--arms", "base", "--cap_gib", "2", "--out", str(tmp_path / "p"),
           "--timeout_s", "600")
    assert any((tmp_path / "p").rglob("*.json"))


@root_only
def test_capacity_searches_one_depth_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    """launch/capacity.py's command (search, capped attempt, table, plot) for one configuration, one depth. The
    SmolLM2-1.7B-shaped model it builds per depth is swapped for the tiny model: one such layer is 168 M
    parameters, minutes to build and run. tests/test_capacity.py covers an attempt that runs out of memory."""
    from launch import capacity
    from launch.memcap import leftover_groups

    monkeypatch.setattr(capacity, "build_1_7b_shaped", lambda layers, models_dir: "tiny")
    out = tmp_path / "capacity"
    assert capacity.main(["--cap_gib", "2", "--configs", "s0-dense-1r", "--max_layers", "1", "--timeout_s", "600",
                          "--out", str(out)]) == 0
    rows = json.loads((out / "capacity.json").read_text())
    assert [(r["config"], r["layers"], r["run"]["outcome"]) for r in rows] == [("s0-dense-1r", 1, "complete")]
    assert rows[0]["run"]["peak_rss_bytes"][0] > 0
    assert "| s0-dense-1r | 2.00 | 1 | " in (out / "capacity.md").read_text()
    assert (out / "capacity.png").stat().st_size > 1000
    assert "s0-dense-1r L=1: complete" in capsys.readouterr().out
    assert leftover_groups(f"nshard-cap-{os.getpid()}-") == []


def test_recipe_sweep_runs_two_points_on_the_tiny_plan_and_keeps_every_attempt(tmp_path):
    """Two learning rates, two updates each, on development seeds with the distinct training data set per point,
    then the chosen point again on a second development seed: a record of every run, the seed scored once per
    prepared identity and reused, the choice made by the declared rule, each point's sequence budget."""
    record = tmp_path / "record" / "sweep"
    proc = script("launch.recipe_sweep", "--plan", "launch/plans/tiny.toml", "--lrs", "1e-3", "3e-3", "--updates", "2",
                  "--cases_per_family", "3", "--confirm_offset", "201",
                  "--out", str(tmp_path / "sweep"), "--record", str(record), timeout=1200)
    body = json.loads(record.with_suffix(".json").read_text())
    assert [p["point"] for p in body["points"]] == ["lr0.001-u2-c3", "lr0.003-u2-c3"]
    assert all(p["status"] == "complete" and p["cases"] == 16 for p in body["points"])
    plan = (tmp_path / "sweep" / "dev200" / "lr0.001-u2-c3" / "plan.toml").read_text()
    assert "seed = 207" in plan and "eval_seed = 7207" in plan  # development data, never the final cases
    assert "train_cases_per_family = 3" in plan
    assert "score seed: scored earlier under the same commitment; reused" in (
        tmp_path / "sweep" / "dev200" / "lr0.003-u2-c3" / "log.txt").read_text()
    tokens = body["points"][0]["train_tokens"]
    assert 0 < tokens["response_tokens"] < tokens["tokens"] and tokens["distinct_documents"] <= tokens["documents"]
    confirm = body["confirmation"]
    assert confirm["status"] == "complete" and confirm["dev_seed_offset"] == 201
    assert confirm["point"] == body["chosen"]["point"]
    assert "seed = 208" in (tmp_path / "sweep" / "dev201" / confirm["point"] / "plan.toml").read_text()
    md = record.with_suffix(".md").read_text()
    assert "| lr0.003-u2-c3 | complete |" in md and "Second development seed (+201)" in md
    assert json.loads(proc.stdout.strip().splitlines()[-1])["record"] == str(record)

    # The candidate at the chosen recipe: the plan's PowerSGD arm on two ranks with rank 2 (the tiny model's
    # matrices are too small for the ds_config's 32), paired with the chosen point's one-rank answers.
    chosen = body["chosen"]["point"]
    control = tmp_path / "sweep" / "dev200" / chosen / "study"
    candidate = tmp_path / "record" / "candidate"
    script("launch.recipe_sweep", "--plan", "launch/plans/tiny.toml", "--lrs", str(body["chosen"]["lr"]),
           "--updates", "2", "--cases_per_family", "3", "--candidate_ds_config", "ds_configs/powersgd.json",
           "--dense_warmups", "1", "--powersgd_ranks", "2", "--control", str(control),
           "--out", str(tmp_path / "sweep"), "--record", str(candidate), timeout=1200)
    body = json.loads(candidate.with_suffix(".json").read_text())
    (p,) = body["points"]
    assert p["status"] == "complete" and p["point"] == f"{chosen}-w1-r2" and body["chosen"]["point"] == p["point"]
    assert p["paired"]["n"] == 16 and p["paired"]["control_arm"] == "one-rank"
    folder = tmp_path / "sweep" / "dev200" / p["point"]
    assert 'name = "powersgd"\nranks = 2' in (folder / "plan.toml").read_text()
    nshard = json.loads((folder / "ds_config.json").read_text())["nshard"]
    assert (nshard["dense_warmup_updates"], nshard["rank"]) == (1, 2)
    assert "score seed: scored earlier under the same commitment; reused" in (folder / "log.txt").read_text()
    assert "| paired vs control (discordant, lost), 99% interval |" in candidate.with_suffix(".md").read_text()


def test_bench_precision_times_fp32_bf16_and_autocast_in_one_run(tmp_path):
    """Every mode trains the same batch in its own process on the real engine; the table compares each with fp32."""
    out = tmp_path / "precision.json"
    proc = script("launch.bench_precision", "--plan", "launch/plans/tiny.toml", "--ds_config", "ds_configs/dense.json",
                  "--sizes", "2", "--updates", "1", "--batch_docs", "4", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["fp32", "bf16", "autocast"] and all(r["median_s"] > 0 for r in rows)
    assert "| bf16 | 2 |" in proc.stdout and "bf16 units:" in proc.stdout


def test_bench_generate_times_fp32_and_bf16_scoring_on_the_tiny_model():
    proc = script("launch.bench_generate", "--model", "tiny", "--plan", "launch/plans/tiny.toml", "--cases", "8",
                  "--max-new-tokens", "4", "--cores", "2", "--decoders", "greedy,hf")
    body = json.loads(proc.stdout)
    assert set(body["settings"]) == {f"{d} {m} {p}" for d in ("float32", "bfloat16") for m in ("greedy", "hf")
                                     for p in ("1x2", "2x1")}
    assert all(s["cases"] == 8 and s["per_model_s"] > 0 for s in body["settings"].values())
    # Two processes with the same settings give the same token ids (what validation's regeneration relies on).
    assert body["identical_token_ids"]["bfloat16 greedy 2x1: every process"]
    assert body["identical_token_ids"]["float32 greedy 2x1: every process"]
    cut, full = (body["settings"][f"float32 {m} 1x2"]["new_tokens"] for m in ("greedy", "hf"))
    assert 0 < cut <= full  # transformers' generate never cuts an answer
