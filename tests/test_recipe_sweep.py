"""launch/recipe_sweep.py's rules, on records made up here (its runs on the tiny plan are in test_launch_scripts.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runs import REPO, run_env

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launch.recipe_sweep import candidate_ds_config, choose_candidate, lost_cases


def point(warmups, rank, lower, retention=-0.1, status="complete", offset=400):
    return {"point": f"w{warmups}-r{rank}", "status": status, "dense_warmup_updates": warmups, "powersgd_rank": rank,
            "retention_upper_nats": retention, "paired": {"lower_points": lower}, "dev_seed_offset": offset}


def test_the_candidate_rule_takes_the_least_traffic_that_passes_both_bounds():
    """Fewest dense warm-up updates first, then the lowest rank, among points whose paired lower bound clears the
    margin and whose retention bound passes; a failed point, a bound on the margin, a retention fail never count."""
    points = [point(1, 32, -5.4), point(3, 64, -1.0), point(3, 32, -2.9), point(2, 32, -3.0), point(2, 16, -1.0, 0.03),
              point(1, 16, 0.0, status="failed")]
    assert choose_candidate(points, 0.02, -3.0)["point"] == "w3-r32"
    assert choose_candidate(points[:1], 0.02, -3.0) is None


def test_with_two_seeds_a_point_counts_only_if_it_clears_the_margin_on_both():
    """The stricter development margin (-2) on both seeds: a point that passes on one seed only, or never ran on the
    second, is not chosen; the entry returned is the first seed's."""
    points = [point(3, 32, -1.86), point(3, 32, -2.28, offset=500), point(5, 32, -1.5), point(7, 32, -1.0),
              point(7, 32, -1.9, offset=500)]
    assert choose_candidate(points, 0.02, -3.0, (400, 500))["point"] == "w3-r32"
    chosen = choose_candidate(points, 0.02, -2.0, (400, 500))
    assert chosen["point"] == "w7-r32" and chosen["dev_seed_offset"] == 400
    assert choose_candidate(points[:3], 0.02, -2.0, (400, 500)) is None
    assert choose_candidate(points[2:3], 0.02, -2.0)["point"] == "w5-r32"  # one seed declared: one run is enough


def test_a_cap_on_lost_cases_counts_the_control_s_right_answers_the_candidate_gets_wrong():
    """4 discordant, 2 each way: 2 lost; 3 discordant at one case fewer right: 2 lost; 4 discordant at two fewer: 3."""
    paired = {"discordant": 4, "candidate_correct": 36, "control_correct": 36}
    assert lost_cases(paired) == 2 and lost_cases({**paired, "discordant": 3, "candidate_correct": 35}) == 2
    assert lost_cases({**paired, "candidate_correct": 34}) == 3
    points = [dict(point(5, 32, -2.1), paired={"lower_points": -2.1, **paired, "candidate_correct": 34}),
              dict(point(7, 32, -2.0), paired={"lower_points": -2.0, **paired})]
    assert choose_candidate(points, 0.02, -3.0, max_lost=2)["point"] == "w7-r32"
    assert choose_candidate(points, 0.02, -3.0)["point"] == "w5-r32"


def test_a_development_margin_below_the_screen_is_refused(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    (control / "results.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "launch.recipe_sweep", "--plan", "launch/plans/tiny.toml",
                           "--lrs", "1e-3", "--candidate_ds_config", "ds_configs/powersgd.json",
                           "--control", str(control), "--margin", "-4"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "--margin -4.0: below the plan's screen" in proc.stderr.strip().splitlines()[-1]


def test_the_candidate_ds_config_sets_the_rate_warm_up_and_rank_and_refuses_a_dense_reducer():
    base = json.loads((REPO / "ds_configs" / "cpu-powersgd.json").read_text())
    config = candidate_ds_config(base, 3e-4, "decay", 4, 64)
    assert config["nshard"]["dense_warmup_updates"] == 4 and config["nshard"]["rank"] == 64
    assert config["optimizer"]["params"]["lr"] == 3e-4 and config["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert base["nshard"]["rank"] == 32  # the base is not changed
    with pytest.raises(SystemExit, match="nshard.reducer is powersgd"):
        candidate_ds_config(json.loads((REPO / "ds_configs" / "cpu-dense.json").read_text()), 2e-4, "decay", 1, 32)


def test_a_candidate_sweep_without_its_control_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.recipe_sweep", "--plan", "launch/plans/tiny.toml",
                           "--lrs", "1e-3", "--candidate_ds_config", "ds_configs/powersgd.json",
                           "--control", str(tmp_path)], cwd=REPO, env=run_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "--control" in proc.stderr.strip().splitlines()[-1]
    assert "no results.json" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "launch.recipe_sweep", "--plan", "launch/plans/tiny.toml",
                           "--lrs", "1e-3", "2e-3", "--candidate_ds_config", "ds_configs/powersgd.json"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "one recipe" in proc.stderr.strip().splitlines()[-1]


def test_a_control_scored_another_way_is_refused_before_anything_trains(tmp_path):
    """Scores made in another dtype than this machine scores the control's arm in (an fp32 scoring of a bf16 run)
    can't be paired with a point scored here: refused up front, naming the fix, not after the point has trained."""
    control = tmp_path / "control"
    (control / "arms" / "one-rank").mkdir(parents=True)
    (control / "arms" / "one-rank" / "ds_config.json").write_text((REPO / "ds_configs" / "cpu-dense.json").read_text())
    (control / "results.json").write_text(json.dumps({"candidate": "one-rank"}))
    for label in ("seed", "one-rank"):
        (control / "eval" / label).mkdir(parents=True)
        (control / "eval" / label / "summary.json").write_text(json.dumps({"device": "cpu", "dtype": "float16"}))
    proc = subprocess.run([sys.executable, "-m", "launch.recipe_sweep", "--plan", "launch/plans/tiny.toml",
                           "--lrs", "1e-3", "--candidate_ds_config", "ds_configs/powersgd.json",
                           "--control", str(control)], cwd=REPO, env=run_env(), capture_output=True, text=True)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "seed was scored on cpu in float16" in last and "move" in last
