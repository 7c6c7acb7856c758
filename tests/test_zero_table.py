"""The ZeRO stage comparison: optimizer memory per rank (2 gloo ranks, in process), the table writer on
synthetic run directories (no launches), the table of the six stage runs the suite shares, and launch/zero_stages.py
end to end on stage 0 (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nshard.analysis.zero_table import TableError, load_weights, main, write_table  # noqa: E402 -- after sys.path takes the checkout
from spawn import run_ranks  # noqa: E402 -- after sys.path takes the checkout

ROOT_A, ROOT_B = "a" * 64, "b" * 64


def weights(shift: float = 0.0) -> dict:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3) + np.float32(shift), "b": np.ones(3, np.float32)}


def make_arm(root: Path, name: str, stage: int, reducer: str, roots=(ROOT_A, ROOT_A), shift: float = 0.0,
             grad_bytes=((100, 10, 12), (100, 10, 14)), plan_sha256="f" * 64, gpu=False) -> Path:
    """A finished 2-rank, 3-update run directory: one dense warm-up update, then two compressed ones."""
    arm = root / name
    (arm / "receipts").mkdir(parents=True)
    (arm / "model").mkdir()
    (arm / "run.json").write_text(json.dumps({"status": "complete", "plan": "tiny", "plan_sha256": plan_sha256,
                                              "world_size": 2, "zero_stage": stage, "reducer": reducer}))
    losses = (2.0, 1.5, 1.25 + stage)
    (arm / "metrics.jsonl").write_text("".join(json.dumps({"update": i + 1, "loss": v}) + "\n"
                                               for i, v in enumerate(losses)))
    for rank in (0, 1):
        receipt = {"rank": rank, "world_size": 2, "update_s": [0.5, 0.2 + rank, 0.3],
                   "update_grad_bytes": list(grad_bytes[rank]), "update_compressed": [False, True, True],
                   "parameter_root": roots[rank], "peak_rss_bytes": (300 + rank) * 2**20,
                   "optimizer_state_bytes": 4096 // (1 + (stage > 0)), "master_param_bytes": 0 if stage == 0 else 1024,
                   "update_parameter_bytes": [0 if stage == 0 else 512 + 256 * rank] * 3,
                   **({"peak_allocated_bytes": 2**30} if gpu else {})}
        (arm / "receipts" / f"rank-{rank}.json").write_text(json.dumps(receipt))
    save_file(weights(shift), str(arm / "model" / "model.safetensors"))
    nshard = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1} if reducer == "powersgd" else None
    (arm / "ds_config.json").write_text(json.dumps({"optimizer": {"params": {"lr": 2e-3}}, "nshard": nshard}))
    return arm


def test_rows_medians_and_formats(tmp_path):
    # The stage-1 shift, 2**-18, is exact in float32 next to the weights 0..5.
    make_arm(tmp_path, "stage0-powersgd", 0, "powersgd")
    make_arm(tmp_path, "stage1-powersgd", 1, "powersgd", roots=(ROOT_B, ROOT_B), shift=2.0**-18)
    make_arm(tmp_path, "stage0-dense", 0, "deepspeed", grad_bytes=((100,) * 3,) * 2)
    (tmp_path / "logs").mkdir()  # directories without run.json are not arms
    table = write_table(tmp_path)
    rows = {r["arm"]: r for r in table["arms"]}
    assert [r["arm"] for r in table["arms"]] == ["stage0-dense", "stage0-powersgd", "stage1-powersgd"]
    z1 = rows["stage1-powersgd"]
    assert z1["payload_bytes_compressed_median"] == 11  # median of 10, 12, 10, 14: every rank's compressed updates
    assert z1["payload_bytes_dense_median"] == 100
    assert z1["update_s_median"] == 0.4 and z1["update_s_compressed_median"] == 0.3
    assert z1["final_loss"] == 2.25 and z1["compressed_updates"] == 2
    assert z1["optimizer_state_bytes"] == [2048, 2048] and z1["peak_allocated_bytes"] is None
    assert z1["root_equals_stage0"] is False and z1["max_abs_diff_vs_stage0"] == 2.0**-18
    assert rows["stage0-powersgd"]["root_equals_stage0"] is None
    md = (tmp_path / "zero_table.md").read_text()
    assert json.loads((tmp_path / "zero_table.json").read_text()) == json.loads(json.dumps(table))
    assert not list(tmp_path.glob("*.tmp"))
    line = next(x for x in md.splitlines() if x.startswith("| stage1-powersgd"))
    assert "| 2/3 | 300.0 MiB / 301.0 MiB | 2.0 KiB / 2.0 KiB | 1.0 KiB / 1.0 KiB | 11 B | 100 B | 640 B |" in line
    assert rows["stage0-powersgd"]["parameter_bytes_median"] == 0
    assert "| 0.400 | 0.300 | 2.2500 | `bbbbbbbbbbbb` | no | 3.81e-06 |" in line
    assert "GPU peak" not in md and "WARNING" not in md
    assert "Settings: lr 0.002; nshard powersgd rank 2, 1 dense warm-up update(s)." in md


def test_gpu_peak_column_only_when_receipts_have_it(tmp_path):
    make_arm(tmp_path, "stage0-dense", 0, "deepspeed", gpu=True)
    assert "| 1.00 GiB / 1.00 GiB |" in (write_table(tmp_path) and (tmp_path / "zero_table.md").read_text())


def test_ranks_that_disagree_are_flagged(tmp_path):
    make_arm(tmp_path, "stage0-dense", 0, "deepspeed")
    make_arm(tmp_path, "stage2-dense", 2, "deepspeed", roots=(ROOT_A, ROOT_B))
    row = write_table(tmp_path)["arms"][1]
    assert row["ranks_agree"] is False and row["root_equals_stage0"] is None
    md = (tmp_path / "zero_table.md").read_text()
    assert "**RANKS DISAGREE** `aaaaaaaaaaaa` / `bbbbbbbbbbbb`" in md
    assert "WARNING**: the ranks of stage2-dense disagree" in md


def test_malformed_or_missing_receipt_names_the_file(tmp_path, capsys):
    arm = make_arm(tmp_path, "stage1-dense", 1, "deepspeed")
    receipt = arm / "receipts" / "rank-1.json"
    receipt.write_text('{"rank": 1, ')
    with pytest.raises(TableError, match=r"rank-1\.json: not valid JSON"):
        write_table(tmp_path)
    receipt.write_text(json.dumps({"rank": 1}))
    with pytest.raises(TableError, match=r"rank-1\.json lacks \['update_s'"):
        write_table(tmp_path)
    receipt.unlink()
    assert main([str(tmp_path)]) == 2
    assert f"{receipt} is missing" in capsys.readouterr().err
    assert not (tmp_path / "zero_table.md").exists()


def test_unfinished_runs_and_mixed_plans_are_refused(tmp_path):
    arm = make_arm(tmp_path, "stage0-dense", 0, "deepspeed")
    make_arm(tmp_path, "stage1-dense", 1, "deepspeed", plan_sha256="e" * 64)
    with pytest.raises(TableError, match="different plans"):
        write_table(tmp_path)
    run = json.loads((arm / "run.json").read_text())
    (arm / "run.json").write_text(json.dumps({**run, "status": "running"}))
    with pytest.raises(TableError, match=r"stage0-dense/run\.json: status 'running'"):
        write_table(tmp_path)
    with pytest.raises(TableError, match="no run directories"):
        write_table(tmp_path / "logs")


def test_bf16_weights_are_widened_without_torch(tmp_path):
    # 1.0, -2.5 and 2**-10 in bfloat16 are the top 16 bits of their float32 patterns.
    values = np.array([1.0, -2.5, 2.0**-10], np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, len(bits)]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bits)
    np.testing.assert_array_equal(load_weights(tmp_path)["x"], values)


def test_table_writer_runs_as_a_script_without_torch(tmp_path):
    make_arm(tmp_path, "stage0-dense", 0, "deepspeed")
    code = "\n".join(["import runpy, sys", "sys.argv = ['zero_table.py', sys.argv[1]]",
                      "try:", "    runpy.run_path('analysis/zero_table.py', run_name='__main__')",
                      "except SystemExit as exc:", "    assert exc.code == 0, exc.code",
                      "assert 'torch' not in sys.modules, 'the table writer imported torch'"])
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# ZeRO stages: plan `tiny`")


# ---------------------------------------------------------------- optimizer memory per rank


def _optimizer_memory_by_stage(rank, world_size):
    import os

    import torch

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))  # as the launcher would

    from nshard.seam.engine import build_engine
    from nshard.seam.patches import optimizer_memory

    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))  # sizes that do not split evenly
        config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "reduce_scatter": False, "overlap_comm": False}}
        engine = build_engine(model, config)
        engine.backward(engine(torch.randn(1, 33)).square().sum())
        engine.step()  # AdamW makes its state on the first step
        out[stage] = optimizer_memory(engine)
    return out


def test_zero_partitions_optimizer_state_and_keeps_fp32_masters_per_rank():
    by_rank = run_ranks(_optimizer_memory_by_stage, timeout_s=300)
    param_bytes = 4 * (33 * 17 + 17 + 17 * 5 + 5)
    for ranks in by_rank:
        assert ranks[0]["master_param_bytes"] == 0  # fp32 stage 0 steps the module's own parameters
        assert ranks[0]["optimizer_state_bytes"] >= 2 * param_bytes  # exp_avg + exp_avg_sq (+ step)
        for stage in (1, 2):
            # Half of each, give or take DeepSpeed's alignment padding of the flat partition.
            assert ranks[stage]["optimizer_state_bytes"] == pytest.approx(ranks[0]["optimizer_state_bytes"] / 2,
                                                                          abs=64)
            assert ranks[stage]["master_param_bytes"] == pytest.approx(param_bytes / 2, abs=32)


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def stage_runs(runs_root):
    """The comparison's six arms, as stage{0,1,2}-{dense,powersgd}: shared runs that other files launch too
    (tests/test_arms.py's stages under DeepSpeed's reduction, tests/test_reducer_engine.py's under PowerSGD)."""
    from runs import cached_run, tiny_config
    from test_reducer_engine import psgd

    dense = {0: ("ds-dense", tiny_config()), 1: ("ds-zero1", tiny_config("zero1")), 2: ("ds-zero2", tiny_config("zero2"))}
    arms = {}
    for stage in (0, 1, 2):
        arms[f"stage{stage}-dense"] = cached_run(runs_root, *dense[stage])
        arms[f"stage{stage}-powersgd"] = cached_run(runs_root, f"psgd-z{stage}", tiny_config(stage=stage, nshard=psgd()))
    return arms


@pytest.mark.slow
def test_zero_table_of_the_shared_stage_runs(stage_runs, tmp_path):
    out = tmp_path / "zero-stages"
    out.mkdir()
    for name, run in stage_runs.items():
        (out / name).symlink_to(run, target_is_directory=True)
    assert main([str(out)]) == 0
    rows = {(r["reducer"], r["stage"]): r for r in json.loads((out / "zero_table.json").read_text())["arms"]}
    assert len(rows) == 6 and all(r["ranks_agree"] for r in rows.values())
    assert len([x for x in (out / "zero_table.md").read_text().splitlines() if x.startswith("| stage")]) == 6
    for reducer in ("deepspeed", "powersgd"):
        stage0 = rows[reducer, 0]["optimizer_state_bytes"]
        for stage in (1, 2):
            row = rows[reducer, stage]
            assert all(z < s for z, s in zip(row["optimizer_state_bytes"], stage0)), row
            assert row["max_abs_diff_vs_stage0"] <= 1e-5, row
    for stage in (0, 1, 2):
        assert rows["powersgd", stage]["compressed_updates"] == 2
        assert rows["powersgd", stage]["payload_bytes_compressed_median"] < rows["deepspeed", stage][
            "payload_bytes_dense_median"]


@pytest.mark.slow
def test_zero_stages_script_runs_its_arms_and_writes_the_table(tmp_path):
    """launch/zero_stages.py end to end, stage 0 only (its two arms through DeepSpeed's runner): the table of every
    stage is the test above, from runs the suite launches anyway."""
    out = tmp_path / "zero-stages"
    cmd = [sys.executable, "-m", "launch.zero_stages", "--out", str(out), "--stages", "0",
           "--rank", "2", "--warmup", "1", "--lr", "2e-3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["reducer"], r["stage"]): r for r in json.loads((out / "zero_table.json").read_text())["arms"]}
    assert sorted(rows) == [("deepspeed", 0), ("powersgd", 0)] and all(r["ranks_agree"] for r in rows.values())
    assert not (out / "stage0-powersgd" / "state").exists()  # the arms' resumable states are removed
    assert rows["powersgd", 0]["compressed_updates"] == 2
    assert rows["powersgd", 0]["payload_bytes_compressed_median"] < rows["deepspeed", 0]["payload_bytes_dense_median"]
