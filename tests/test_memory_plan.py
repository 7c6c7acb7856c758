"""Memory planned before launch (analysis/memory_model.py plan_peak): shapes from a config equal transformers' on the
meta device, ZeRO stages order as they must, a plan that cannot fit is refused in one line naming its largest parts
and a fix, nshard/train.py refuses it before any process group exists, and the CPU prediction of a tiny run bounds its
measured peak resident set."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from runs import REPO, cached_run, receipts, tiny_config

from nshard.analysis import memory_model as mm
from nshard.run.plan import load_plan

SPECS = ("tiny", "embedded", "random:smollm2-1.7b", "random:mixtral-4x135m")


def plan_with(spec: str, **train):
    plan = load_plan(REPO / "launch/plans/study.toml")
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, spec=spec),
                               train=dataclasses.replace(plan.train, **train))


def ds(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


@pytest.mark.parametrize("spec", SPECS)
def test_shapes_from_a_config_are_transformers_own_on_the_meta_device(tmp_path, spec):
    from nshard.run.training import meta_shapes

    config = mm.spec_config(spec)
    kind = config.pop("model_type")
    from transformers import AutoConfig

    AutoConfig.for_model(kind, **config).save_pretrained(tmp_path)
    assert mm.config_shapes({"model_type": kind, **config}).shapes == meta_shapes(tmp_path)


def test_a_grown_qwen2_moe_config_has_the_shapes_nshard_grow_writes(tmp_path):
    """grown_config's Qwen2-MoE (the plan's growth.architecture, expert_size) is the config nshard.grow writes, and
    its derived shapes are transformers' own on the meta device: routed experts, router, shared expert and gate."""
    from transformers import AutoConfig

    from nshard.grow import Growth, qwen2_moe_config
    from nshard.run.training import meta_shapes

    dense = mm.spec_config("embedded")
    config = mm.grown_config(dense, 4, 1, "qwen2_moe", 384)
    written = qwen2_moe_config(AutoConfig.for_model(**dense), Growth(experts=4, top_k=1, architecture="qwen2_moe",
                                                                     expert_size=384))
    written.save_pretrained(tmp_path)
    assert mm.config_shapes(config).shapes == meta_shapes(tmp_path)
    shapes = mm.config_shapes(config)
    assert (shapes.experts, shapes.top_k, shapes.intermediate, shapes.shared_intermediate) == (4, 1, 384, 1536)
    smaller = mm.grown_config(config, 3, 1)  # find_fix's fewer experts keep the design
    assert smaller["model_type"] == "qwen2_moe" and smaller["moe_intermediate_size"] == 384


def test_the_tiny_config_is_the_tiny_model_s():
    from nshard.run.models import TINY_CONFIG, TINY_VOCAB

    assert {k: mm.TINY[k] for k in TINY_CONFIG if k in mm.TINY} == {k: v for k, v in TINY_CONFIG.items() if k in mm.TINY}
    assert mm.TINY["vocab_size"] == TINY_VOCAB


def test_experts_compress_one_matrix_each_as_the_reducer_lays_them_out():
    from nshard.comm.layout import build_layout

    shapes = mm.config_shapes(mm.spec_config("random:mixtral-4x135m"))
    layout = build_layout(shapes.shapes, 32, 2.0)
    compressed = sum(s.n * s.m for s in layout.matrices)
    assert mm.compression(shapes, 32, 2.0) == (compressed, layout.p_numel + layout.q_numel)


def test_zero_stages_pool_the_1_7b_model_in_order():
    plan = plan_with("random:smollm2-1.7b", global_batch_docs=8)  # one microbatch of 4 documents per rank per update
    peak = {stage: mm.plan_peak(plan, ds(name), 2, "H100-80GB")
            for stage, name in ((0, "dense"), (1, "zero1"), (2, "zero2"))}
    params = peak[0]["params"]
    assert params == 1_711_376_384 and peak[0]["microbatches"] == 1
    assert peak[0]["peak_bytes"] > peak[1]["peak_bytes"] >= peak[2]["peak_bytes"]
    moments = {s: peak[s]["parts"]["optimizer_moments"] for s in peak}
    assert moments == {0: 8 * params, 1: 4 * params, 2: 4 * params}
    # With several microbatches ZeRO-1 keeps whole gradients until the update's boundary; ZeRO-2 reduces at each.
    several = plan_with("random:smollm2-1.7b", global_batch_docs=32)
    one, two = (mm.plan_peak(several, ds(name), 2, "H100-80GB") for name in ("zero1", "zero2"))
    assert one["microbatches"] == 4 and one["peak_bytes"] > two["peak_bytes"]
    # One rank pools nothing: every stage keeps the whole optimizer state.
    alone = mm.plan_peak(plan, ds("zero2"), 1, "H100-80GB")
    assert alone["parts"]["optimizer_moments"] == 8 * params and alone["peak_bytes"] > peak[2]["peak_bytes"]


def test_overlap_backward_keeps_fp32_sums_and_its_buckets_alive_in_the_backward():
    """nshard.overlap_backward: the ingest seam sums into fp32 buffers (4P, not 4D) and the buckets' flat buffers
    are alive in the backward beside the activations; at stage 0 in fp32 only the latter. Both predictions in one run."""
    plan = plan_with("random:smollm2-1.7b", global_batch_docs=8)  # one microbatch per rank: sums in the error memory
    for name in ("cpu-zero2-powersgd", "cpu-powersgd"):
        plain_ds = ds(name)
        overlap_ds = {**plain_ds, "nshard": {**plain_ds["nshard"], "overlap_backward": True}}
        plain, overlap = (mm.run_config(plan, d, 2, mm.resolve_device("cpu", 2)) for d in (plain_ds, overlap_ds))
        assert overlap.overlap_backward and not plain.overlap_backward
        shapes = mm.config_shapes(mm.spec_config(plan.model.spec))
        before, after = mm.phases(shapes, plain), mm.phases(shapes, overlap)
        params = shapes.params
        compressed, _ = mm.compression(shapes, plain.rank, plain.min_compression_rate)
        assert before["backward"]["comm"] == 0 and after["backward"]["comm"] >= 4 * (params - compressed)
        if name == "cpu-zero2-powersgd":  # the ingest seam
            assert plain.sums_in_error and not overlap.sums_in_error
            assert (before["backward"]["accumulators"], after["backward"]["accumulators"]) == \
                   (4 * (params - compressed), 4 * params)
        else:  # stage 0, fp32: .grad, no sums either way
            assert before["backward"]["accumulators"] == after["backward"]["accumulators"] == 0
        assert {k: v for k, v in after["backward"].items() if k not in ("comm", "accumulators")} == \
               {k: v for k, v in before["backward"].items() if k not in ("comm", "accumulators")}
        peak = {o: mm.plan_peak(plan, d, 2, "cpu") for o, d in ((False, plain_ds), (True, overlap_ds))}
        assert peak[True]["peak_bytes"] > peak[False]["peak_bytes"], name


def test_a_plan_that_cannot_fit_gets_one_line_naming_its_largest_parts_and_a_fix():
    plan = plan_with("random:smollm2-1.7b")
    report = mm.plan_peak(plan, ds("dense"), 1, "A100-40GB")
    assert not report["fits"] and report["peak_bytes"] > report["usable_bytes"]
    assert set(report["parts"]) <= set(mm.PART_LABELS) and report["parts"]["optimizer_moments"] > 0
    line = mm.refusal(report, "plan study on 1 rank")
    assert "\n" not in line and "fix: " in line and "optimizer moments" in line and "activations" in line
    # The fix it names does fit: re-predicted with that setting.
    assert "activation_checkpointing" in report["fix"]
    fixed = mm.plan_peak(plan, {**ds("dense"), "activation_checkpointing": {}}, 1, "A100-40GB")
    assert fixed["fits"] and fixed["fix"] is None
    # A grown Mixtral of 5.3B at ZeRO-2 with separate microbatch sums (launch/plans/growth.toml) needs more than an
    # 80 GB GPU; the fix offered starts with summing microbatches into the error memory.
    growth = load_plan(REPO / "launch/plans/growth.toml")
    grown = mm.plan_peak(growth, ds("zero2-powersgd"), 2, "H100-80GB", spec="random:smollm2-1.7b", grown=True)
    assert not grown["fits"] and grown["params"] > 5e9 and "nshard.microbatch_sums" in grown["fix"]
    assert mm.plan_peak(growth, ds("zero2-powersgd"), 2, "H200", spec="random:smollm2-1.7b", grown=True)["fits"]


def test_the_capacity_override_replaces_the_device_s(monkeypatch):
    plan = plan_with("tiny")
    assert mm.plan_peak(plan, ds("dense"), 1, "cpu")["fits"]
    monkeypatch.setenv(mm.CAPACITY_ENV, "0.25")
    report = mm.plan_peak(plan, ds("dense"), 1, "cpu")
    assert report["capacity_bytes"] == 0.25 * 2**30 and not report["fits"]
    monkeypatch.setenv(mm.CAPACITY_ENV, "lots")
    with pytest.raises(ValueError, match=mm.CAPACITY_ENV):
        mm.plan_peak(plan, ds("dense"), 1, "cpu")


TOO_BIG = (REPO / "launch/plans/tiny.toml").read_text().replace('spec = "tiny"', 'spec = "HuggingFaceTB/SmolLM2-1.7B-Instruct"')


@pytest.mark.slow
def test_train_refuses_a_plan_that_cannot_fit_before_any_process_group(tmp_path):
    """The 1.7B model on a rank told it has 1 GiB: one error line naming the parts and the fix, exit 2, no run
    directory, no process group (nothing downloaded: the model's config is the shipped one)."""
    plan = tmp_path / "too-big.toml"
    plan.write_text(TOO_BIG)
    out = tmp_path / "run"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               **{mm.CAPACITY_ENV: "1"})
    env.pop(mm.CHECK_ENV, None)
    proc = subprocess.run([sys.executable, str(REPO / "nshard/train.py"), "--ds_config", str(REPO / "ds_configs/dense.json"),
                           "--plan", str(plan), "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nshard: error:")]
    assert len(errors) == 1 and "needs ~" in errors[0] and "holds 1.00 GiB" in errors[0], proc.stderr[-3000:]
    assert "optimizer moments" in errors[0] and "fix: " in errors[0]
    assert not out.exists()
    assert "process group" not in proc.stderr.lower() and "TorchBackend" not in proc.stderr


@pytest.mark.slow
def test_the_cpu_prediction_of_a_tiny_run_bounds_its_peak_resident_set(runs_root):
    """A tiny one-rank run: the predicted peak (the no-model baseline of python, torch and DeepSpeed, and the parts),
    with the margin the check leaves, is at least the measured peak RSS, and the prediction is within 2x of it (on
    the 2-core Zen 2 machine: 513 MB predicted, 477 MB measured)."""
    out = cached_run(runs_root, "ds-one", tiny_config(), world=1)
    measured = receipts(out)[0]["peak_rss_bytes"]
    report = mm.plan_peak(load_plan(REPO / "launch/plans/tiny.toml"), tiny_config(), 1, "cpu")
    assert measured <= report["peak_bytes"] / (1 - mm.MARGIN), (report["peak_bytes"], measured)
    assert report["peak_bytes"] <= 2 * measured, (report["peak_bytes"], measured)


CPU_PLANS = sorted((REPO / "launch/plans").glob("cpu-*.toml"))


@pytest.mark.parametrize("path", CPU_PLANS, ids=lambda p: p.stem)
def test_no_arm_of_a_shipped_cpu_plan_is_refused_on_a_24_gib_machine(path, monkeypatch):
    """Every arm of every shipped CPU plan (a cohort's and a growth's model: the embedded one they continue, grown for a
    growth plan's candidate), planned against this machine kind's 24 GiB shared by the arm's ranks: none is refused
    (training.refused), and where one does not fit, only the activation estimate (an upper bound) is over."""
    from nshard.run.training import refused
    from nshard.seam.ds_config import load_ds_config

    assert CPU_PLANS
    plan = load_plan(path)
    for arm in plan.study.arms:
        monkeypatch.setenv(mm.CAPACITY_ENV, str(24 / arm.ranks))
        grown = plan.growth.enabled and arm.name == plan.study.candidate
        config = load_ds_config(REPO / arm.ds_config)
        report = mm.plan_peak(plan, config, arm.ranks, "cpu", spec="embedded", grown=grown)
        assert not refused(report), (path.stem, arm.name, mm.refusal(report, arm.name))


def test_a_gpu_plan_over_its_device_is_refused_and_a_host_plan_only_for_what_is_certain():
    """refused(): a GPU's whole prediction decides; in host memory only the part that is not the activation estimate."""
    from nshard.run.training import refused

    over = {"fits": False, "peak_bytes": 10, "usable_bytes": 8, "parts": {"activations": 4, "weights": 6}}
    assert refused({**over, "device_kind": "cuda"})
    assert not refused({**over, "device_kind": "cpu"})
    assert refused({**over, "device_kind": "cpu", "parts": {"activations": 1, "weights": 9}})
    assert not refused({**over, "fits": True, "device_kind": "cuda"})
