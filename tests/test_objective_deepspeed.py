"""The objective through the real engine: 2 DeepSpeed ranks, gradient accumulation with a partial
microbatch, against a per-document reference and torch's AdamW.

With eps = 1 the first AdamW step is about lr * g / (|g| + 1), which is nearly linear in g: a
normalization error (a missing factor of world size or of accumulation steps) moves the result,
where the usual eps would hide it (Adam's first step is scale-invariant).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nshard.run.data import Prepared
from nshard.run.models import load_model, resolve_model
from nshard.run.plan import load_plan
from runs import ds_config, final_params, launch
from test_objective import reference_grads

LR, EPS = 1e-2, 1.0


def read_prepared(out: Path) -> list[Prepared]:
    rows = [json.loads(l) for l in (out / "prepared" / "documents.jsonl").read_text().splitlines()]
    return [Prepared(r["doc_id"], r["input_ids"], r["weights"]) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["dense", "zero2"])
def test_one_update_matches_the_per_document_reference(tmp_path, config):
    cfg = ds_config(config)
    cfg["optimizer"]["params"].update(lr=LR, eps=EPS)
    cfg.pop("scheduler")
    cfg["gradient_clipping"] = 0.0
    plan = tmp_path / "plan.toml"
    text = (Path(__file__).parent.parent / "launch/plans/tiny.toml").read_text()
    # Each edit must land: if tiny.toml changes, the run would silently lose its partial microbatch.
    for old, new in [("updates = 3", "updates = 1"), ("global_batch_docs = 6", "global_batch_docs = 7")]:
        assert text.count(old) == 1, f"launch/plans/tiny.toml no longer has one line {old!r}"
        text = text.replace(old, new)
    plan.write_text(text)
    train = load_plan(plan).train
    assert (train.updates, train.global_batch_docs, train.microbatch_docs) == (1, 7, 2)
    out = tmp_path / "run"
    launch(out, cfg, plan=plan)  # 7 documents, 2 ranks, microbatch 2: shares of 4 and 3 -> a partial microbatch
    prepared = read_prepared(out)
    batch = json.loads((out / "prepared" / "schedule.json").read_text())[0]
    assert len(batch) == 7
    model = load_model(resolve_model("tiny")).float()
    grads = reference_grads(model, [prepared[i] for i in batch])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, betas=tuple(cfg["optimizer"]["params"]["betas"]),
                            weight_decay=0.0)
    for name, p in model.named_parameters():
        p.grad = grads[name]
    opt.step()
    trained = final_params(out)
    initial = load_file(str(Path(resolve_model("tiny").path) / "model.safetensors"))
    expected = dict(model.named_parameters())
    assert expected and set(trained) == set(expected)  # every trained tensor is compared, none skipped
    for name, p in expected.items():
        assert (trained[name] - initial[name]).abs().max() > 0, name
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-7, msg=name)
