"""The capped harness (launch/capacity.py, launch/memcap.py) and the memory model's arithmetic."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nshard.analysis.memory_model import Config, compression, phases, predict, smollm2_1_7b  # noqa: E402 -- after sys.path takes the checkout
from runs import leftover_shm_workspaces, shm_workspaces  # noqa: E402 -- after sys.path takes the checkout


def test_compression_matches_the_reducers_layout():
    """The model's compressed-element and P/Q counts are the reducer's own (nshard/comm/layout.py)."""
    from nshard.comm.layout import build_layout

    shapes = smollm2_1_7b(2)
    layout = build_layout(shapes.shapes, 32, 2.0)
    compressed = sum(s.n * s.m for s in layout.matrices)
    assert compression(shapes, 32, 2.0) == (compressed, layout.p_numel + layout.q_numel)


def test_pooling_shrinks_the_optimizer_and_the_ingest_path_pays_it_back():
    shapes = smollm2_1_7b(4)
    parts = lambda **kw: predict(shapes, Config(**kw))["parts_per_param"]
    assert parts(stage=0, world=1)["optimizer"] == 8
    assert parts(stage=2, world=4)["optimizer"] == 2
    summed = predict(shapes, Config(stage=2, reducer="powersgd", world=2))
    separate = predict(shapes, Config(stage=2, reducer="powersgd", world=2, microbatches=2))
    assert separate["model_bytes"] - summed["model_bytes"] == pytest.approx(4 * compression(shapes, 32, 2.0)[0])
    # Under an nshard reducer ZeRO keeps no bucket: beyond ZeRO dense's own state only the error memory,
    # P/Q, the dense remainder's sums and one-tensor transients remain.
    dense = predict(shapes, Config(stage=2, world=2))["parts_bytes"]
    # No bucket (P < reduce_bucket_size) and no gradient waiting for DeepSpeed's hook (4L).
    assert summed["parts_bytes"]["grads"] == dense["grads"] - 4 * shapes.params - 4 * shapes.largest
    # torch's all_gather_into_tensor on gloo stages the whole model; nshard's in-place ring stages nothing.
    gather = {whole: phases(shapes, Config(stage=2, reducer="powersgd", gather_staged_whole=whole))["all-gather"]
              for whole in (False, True)}
    assert gather[True]["transient"] - gather[False]["transient"] == 4 * shapes.params
    assert gather[False]["grads"] == 0  # ZeRO releases the gradient partition before it gathers


@pytest.mark.slow
def test_capped_run_completes_or_is_reported_out_of_memory(tmp_path):
    """Tiny model, ZeRO-2 + PowerSGD, 2 ranks: fits under 2 GiB per rank; under 200 MiB a rank is
    OOM-killed and the harness says "out of memory" (not a crash, not a hang); no cgroup is left."""
    from launch.capacity import attempt
    from launch.memcap import leftover_groups

    prefix = f"nshard-cap-{os.getpid()}-"
    shm_before = shm_workspaces()
    fits = attempt("s2-powersgd", "tiny", "tiny", 2 * 2**30, tmp_path, timeout_s=400, rank=2)
    assert fits["outcome"] == "complete", fits
    assert all(b > 0 for b in fits["peak_rss_bytes"]) and fits["bytes_per_compressed_update"] > 0
    assert fits["parameter_bytes_per_update"] > fits["bytes_per_compressed_update"]  # ZeRO's all-gather is dense
    starved = attempt("s2-powersgd", "tiny", "tiny-starved", 200 * 2**20, tmp_path, timeout_s=300, rank=2)
    assert starved["outcome"] == "out of memory", starved
    assert sum(starved["oom_kills"]) >= 1 and starved["exit_code"] not in (0, 124)
    assert leftover_groups(prefix) == []
    # The starved rank dies before DeepSpeed's shm workspace name is unlinked; the harness removes it.
    assert leftover_shm_workspaces(shm_before) == []
