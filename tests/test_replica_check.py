"""Replica checks by default: with more than one rank the ranks compare their parameters every
checkpoint.replica_check_every updates (default 4), so a divergence stops the run within that many updates and names
the first parameter that differs; one rank has no replica and checks nothing between saves."""

from __future__ import annotations

import json

import pytest
import torch

from runs import REPO, launch, tiny_config

from nshard.run.plan import CheckpointSection, load_plan
from nshard.run.state import replica_check_interval, replica_digest, replica_fingerprint, sealed_states


def test_the_check_is_on_by_default_with_more_than_one_rank_and_off_for_one():
    plan = load_plan(REPO / "launch/plans/tiny.toml")  # no [checkpoint] section: the defaults
    assert plan.checkpoint.replica_check_every == CheckpointSection().replica_check_every == 4
    assert replica_check_interval(plan.checkpoint, 2) == 4 and replica_check_interval(plan.checkpoint, 8) == 4
    assert replica_check_interval(plan.checkpoint, 1) == 0
    assert replica_check_interval(CheckpointSection(replica_check_every=0), 2) == 0  # asked off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fingerprint_sees_one_changed_element(dtype):
    torch.manual_seed(0)
    params = {"a.weight": torch.randn(300, 70).to(dtype), "b.bias": torch.randn(70).to(dtype)}
    same = {k: v.clone() for k, v in params.items()}
    assert replica_fingerprint(params.items()) == replica_fingerprint(same.items())
    for name in params:
        for index in (0, params[name].numel() - 1):
            nudged = {k: v.clone() for k, v in params.items()}
            flat = nudged[name].view(-1)
            flat[index] = torch.nextafter(flat[index].float(), torch.tensor(float("inf"))).to(dtype)
            if torch.equal(nudged[name], params[name]):  # bf16: the next fp32 value can round back
                flat[index] = flat[index] * 2 + 1
            assert replica_fingerprint(nudged.items()) != replica_fingerprint(params.items()), (name, index)
    # The parameter's name and shape count too, not only its bits.
    assert replica_fingerprint({"c.weight": params["a.weight"]}.items()) != \
        replica_fingerprint({"a.weight": params["a.weight"]}.items())
    # Host tensors are compared by their SHA-256 root (faster than the fingerprint on a CPU).
    assert replica_digest(params.items()) != replica_fingerprint(params.items())


UPDATES = 8
PLAN = (REPO / "launch/plans/tiny.toml").read_text().replace("updates = 3", f"updates = {UPDATES}")


@pytest.mark.slow
def test_a_divergence_stops_the_run_within_the_default_interval_naming_the_parameter(tmp_path):
    """Two gloo ranks with no [checkpoint] section (states only at the end); rank 1's first parameter is nudged after
    update 3 (NSHARD_FAULT=1:3:diverge, nshard/run/fault.py). The default check after update 4 stops both ranks,
    naming model.embed_tokens.weight and rank 1, before the end-of-run state is saved."""
    plan = tmp_path / "eight.toml"
    plan.write_text(PLAN)
    out = tmp_path / "diverged"
    proc = launch(out, tiny_config(), plan=plan, check=False, env={"NSHARD_FAULT": "1:3:diverge"})
    assert proc.returncode != 0
    message = "after update 4 the replicas diverged: the first parameter that differs is model.embed_tokens.weight " \
              "(rank 1 differs from rank 0)"
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]
    assert sealed_states(out) == [] and json.loads((out / "run.json").read_text())["status"] == "running"
