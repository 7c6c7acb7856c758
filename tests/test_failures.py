"""Failures found after the process group starts: every rank stops with one error, none waits, nothing half-made."""

import json

import pytest
import torch

from nshard.run.data import batch_schedule
from nshard.run.hostfile import parse_hostfile
from nshard.run.receipts import parameter_root
from runs import REPO, launch, leftover_shm_workspaces, shm_workspaces, tiny_config
from test_inputs import TINY, train_cli


def launch_plan(tmp_path, plan_text, world=2, extra_args=(), out_name="run"):
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text)
    out = tmp_path / out_name
    proc = launch(out, tiny_config(), world=world, plan=plan, extra_args=extra_args, check=False, timeout=180)
    return proc, out


@pytest.mark.slow
def test_rank0_only_failure_reaches_every_rank(tmp_path):
    """'tiny:abc' fails in rank 0's model build; rank 1 must not wait for it at a barrier."""
    proc, out = launch_plan(tmp_path, TINY.replace('spec = "tiny"', 'spec = "tiny:abc"'))
    assert proc.returncode != 0
    assert proc.stderr.count("nshard: error (rank") == 2, proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_document_too_long_stops_before_the_run_directory(tmp_path):
    proc, out = launch_plan(tmp_path, TINY.replace("max_length = 256", "max_length = 24"))
    assert proc.returncode != 0
    assert "model.max_length" in proc.stderr and "Traceback" not in proc.stderr.split("nshard: error")[0][-200:]
    assert not out.exists()


@pytest.mark.slow
def test_overwrite_only_replaces_a_run_directory(tmp_path):
    precious = tmp_path / "run"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    proc, _ = launch_plan(tmp_path, TINY, world=1, extra_args=["--overwrite"])
    assert proc.returncode != 0 and "not an nshard run directory" in proc.stderr
    assert (precious / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("change,key", [
    ({"zero_optimization": {"stage": 3}, "nshard": {"reducer": "dense"}}, "stage=3"),
    ({"fp16": {"enabled": True}, "nshard": {"reducer": "powersgd"}}, "fp16.enabled"),
    ({"train_batch_size": 7}, "train_batch_size=7"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": True}, "nshard": {"reducer": "powersgd"}},
     "zero_optimization.reduce_scatter"),
    ({"managed_gradient_accumulation": False, "nshard": {"reducer": "powersgd"}}, "managed_gradient_accumulation=false"),
])
def test_ds_config_conflicts_fail_before_training(tmp_path, change, key):
    cfg = json.loads((REPO / "ds_configs/dense.json").read_text())
    cfg.update(change)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert key in train_cli(tmp_path, TINY, ds_config=path)


def test_batches_that_span_epochs_hold_each_document_once():
    for n_docs, batch in [(5, 4), (40, 6), (7, 7)]:
        for b in batch_schedule(n_docs, 25, batch, seed=3):
            assert len(b) == batch == len(set(b))


def test_parameter_root_covers_scalars():
    a = [("s", torch.tensor(1.0)), ("w", torch.ones(2, 2))]
    b = [("s", torch.tensor(2.0)), ("w", torch.ones(2, 2))]
    assert parameter_root(a) != parameter_root(b)


def test_hostfile_takes_trailing_comments_and_names_bad_lines(tmp_path):
    good = tmp_path / "good"
    good.write_text("# cluster\nnode-a slots=8 # first\nnode-b slots=8\n")
    assert parse_hostfile(good) == {"node-a": 8, "node-b": 8}
    bad = tmp_path / "bad"
    bad.write_text("node-a slots=8\nnode-a slots=8\n")
    with pytest.raises(ValueError, match="listed twice"):
        parse_hostfile(bad)


@pytest.mark.slow
def test_runs_leave_no_shared_memory_behind(tmp_path):
    """DeepSpeed's CPU shm all-reduce workspace (66 MB a rank) used to stay in /dev/shm after every run."""
    before = shm_workspaces()
    proc, out = launch_plan(tmp_path, TINY.replace("updates = 3", "updates = 1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover_shm_workspaces(before) == []
