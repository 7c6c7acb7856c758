"""Host syncs inside a timed update: every place the host reads a tensor's value (Tensor.item, tolist, bool, float,
int) or waits for the device (torch.cuda.synchronize) during nshard.run.training.train_update, counted by call site
in a real DeepSpeed engine with nshard's PowerSGD. On a GPU each one drains the device's queue; on the CPU the calls
are counted all the same. The loss is summed on the device and read once per update, after its timing
(training.global_loss), so the training loop itself adds none: it read each microbatch's loss before (3 per update
on the tiny plan)."""

from __future__ import annotations

import collections
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

from runs import REPO, tiny_config
from spawn import run_ranks

pytestmark = pytest.mark.slow  # builds a DeepSpeed engine (no launch)

READS = ("item", "tolist", "__bool__", "__float__", "__int__")
NSHARD = REPO / "nshard"


def counting(calls: collections.Counter):
    """Wrap the tensor reads and torch.cuda.synchronize so each call counts under its caller's file and line."""
    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            frame = traceback.extract_stack(limit=2)[0]
            calls[f"{frame.filename}:{frame.lineno} {name}"] += 1
            return original(*args, **kwargs)
        setattr(owner, name, counted)
        return owner, name, original

    return [wrap(torch.Tensor, name) for name in READS] + [wrap(torch.cuda, "synchronize")]


def updates_counted(rank: int, world: int, config: dict) -> list[dict]:
    """Three updates of the tiny plan through train_update, each update's host syncs by call site."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.path.insert(0, str(REPO))
    from nshard.seam.launch_env import prepare_process_env

    prepare_process_env()  # DeepSpeed's CPU collective from this venv's extensions folder, as a launched rank's
    from nshard.run import data as data_mod
    from nshard.run.models import load_model, load_tokenizer, resolve_model
    from nshard.run.plan import load_plan
    from nshard.run.replay import replay_documents
    from nshard.run.training import Run, train_update
    from nshard.seam import ds_config as dsc
    from nshard.seam import engine as engine_mod

    plan = load_plan(REPO / "launch/plans/tiny.toml")
    ref = resolve_model(plan.model.spec)
    tokenizer = load_tokenizer(ref)
    _, prepared, schedule, _, _ = data_mod.prepare(plan, tokenizer, replay_documents(plan, ref, tokenizer))
    completed = dsc.complete_ds_config(config, plan, 1)
    torch.manual_seed(0)
    engine = engine_mod.build_engine(load_model(ref), completed)
    seam = engine_mod.install_reducer(engine, dsc.reducer_config(config))
    run = Run(plan, REPO / "launch/plans/tiny.toml", Path("/nonexistent"), completed, Path("/nonexistent"), 0, 1,
              dsc.reducer_config(config))
    counts = []
    for batch in schedule[:3]:
        calls = collections.Counter()
        wrapped = counting(calls)
        try:
            local = train_update(engine, seam, run, prepared, batch, tokenizer.pad_token_id)
        finally:
            for owner, name, original in wrapped:
                setattr(owner, name, original)
        counts.append({"calls": dict(calls), "compressed": seam.last_update_compressed(),
                       "local_nll_on_device": isinstance(local, torch.Tensor) and local.dtype == torch.float64})
    return counts


def test_a_timed_update_reads_no_loss_from_the_device():
    """PowerSGD rank 4 on the tiny model, one dense warm-up update then compressed ones: no host read comes from the
    training loop (before: one nll.item() per microbatch); what remains is the reducer's own, each named by its line
    (CholeskyQR2's fallback decision and the zero-Q guard read one small tensor per compressed update)."""
    config = tiny_config(nshard={"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1, "seed": 0})
    seen = run_ranks(updates_counted, world_size=1, args=(config,), timeout_s=1800)[0]
    assert [u["compressed"] for u in seen] == [False, True, True]
    assert all(u["local_nll_on_device"] for u in seen)
    for update in seen:
        from_the_loop = {site: n for site, n in update["calls"].items() if site.startswith(str(NSHARD / "run"))}
        assert from_the_loop == {}, from_the_loop
    # nshard's own: the reducer's, once per compressed update, none in a dense one. transformers' mask building reads
    # the attention mask in every forward (masking_utils), which nshard does not control.
    ours = [{Path(site).name: n for site, n in u["calls"].items() if site.startswith(str(NSHARD))} for u in seen]
    print(f"host reads per update: {[u['calls'] for u in seen]}")
    assert ours[0] == {} and all(0 < sum(o.values()) <= 2 for o in ours[1:]), ours
    assert all(site.startswith(("orthogonal.py", "powersgd.py")) for o in ours for site in o), ours
