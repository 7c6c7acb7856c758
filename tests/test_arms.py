"""One rank vs two ranks (dense) vs two ranks with ZeRO-1 and ZeRO-2: the same plan gives the same model."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nshard.run.models import resolve_model

from runs import cached_run, final_params, receipts, tiny_config


@pytest.fixture(scope="module")
def arms(runs_root):
    return {"one": cached_run(runs_root, "ds-one", tiny_config(), world=1),
            "dense": cached_run(runs_root, "ds-dense", tiny_config()),
            "zero1": cached_run(runs_root, "ds-zero1", tiny_config("zero1")),
            "zero2": cached_run(runs_root, "ds-zero2", tiny_config("zero2"))}


@pytest.mark.slow
def test_arms_agree_within_fp32_tolerance(arms):
    reference = final_params(arms["one"])
    for name in ("dense", "zero1", "zero2"):
        params = final_params(arms[name])
        assert params.keys() == reference.keys()
        for key in reference:
            torch.testing.assert_close(params[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"{name}:{key}")
    initial = load_file(str(Path(resolve_model("tiny").path) / "model.safetensors"))
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    assert moved > 1e-3  # the arms agree on a model that training really changed


@pytest.mark.slow
def test_each_run_has_complete_records_and_ranks_agree(arms):
    for name, out in arms.items():
        run = json.loads((out / "run.json").read_text())
        assert run["status"] == "complete"
        rs = receipts(out)
        assert len(rs) == run["world_size"]
        assert len({r["parameter_root"] for r in rs}) == 1 == len({run["parameter_root"], rs[0]["parameter_root"]})
        assert all(r["updates"] == 3 and len(r["update_s"]) == 3 for r in rs)
        lines = (out / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3 and all(json.loads(l)["lr"] > 0 for l in lines)
    identities = {json.loads((out / "run.json").read_text())["prepared_identity"] for out in arms.values()}
    assert len(identities) == 1  # world size does not enter the prepared identity
    # Two ranks hand one fp32 gradient copy per update to the all-reduce (stage 0).
    dense = receipts(arms["dense"])[0]
    n_params = sum(t.numel() for t in final_params(arms["dense"]).values())
    assert dense["update_grad_bytes"][0] >= 4 * n_params
