"""The CUDA variants, for a GPU host: NSHARD_CUDA_TESTS=1 pytest -m cuda (launch/gpu_check.sh runs them).
In a CPU session every test here is skipped with the reason. Bit-identity is checked between two results of
the same session; CUDA-vs-CPU comparisons use a tolerance (other kernels)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from runs import REPO, final_params, launch, receipts, tiny_config
from spawn import run_ranks
from test_comm_powersgd import CONFIG, SHAPES, grads_for
from test_gpu import GPU_CHECK_POWERSGD, gpu_check, tiny_step_run

pytestmark = pytest.mark.cuda


def reducers_on(device: str, group) -> dict:
    """Dense, PowerSGD with device and with host error memory, fed the same gradients on `device`."""
    from nshard.comm import build_reducer

    reducers = {"dense": build_reducer({**CONFIG, "reducer": "dense"}, group=group),
                "device": build_reducer({**CONFIG, "error_feedback": "device"}, group=group),
                "host": build_reducer({**CONFIG, "error_feedback": "host"}, group=group)}
    outputs = {key: [] for key in reducers}
    for update in range(4):
        for key, reducer in reducers.items():
            grads = {n: g.to(device) for n, g in grads_for(0, update).items()}
            reducer.reduce(grads)
            outputs[key].append({n: g.cpu() for n, g in grads.items()})
    errors = {key: reducers[key].state.errors.tensors for key in ("device", "host")}
    return {"outputs": outputs, "error_places": {key: {(t.device.type, t.is_pinned()) for t in e.values()}
                                                 for key, e in errors.items()}}


def cuda_and_cpu_reducers(rank: int, world: int) -> dict:
    import torch.distributed as dist

    cpu_group = dist.new_group(backend="gloo")  # the CPU reference cannot go through NCCL
    return {"cuda": reducers_on("cuda", None), "cpu": reducers_on("cpu", cpu_group)}


def test_reducers_on_cuda_tensors_match_the_cpu_and_keep_error_memory_where_configured():
    """One NCCL rank: PowerSGD's matmuls and error feedback on CUDA tensors, the error memory on the GPU ("device")
    or pinned in host memory ("host"); device and host give the same bits, and the CPU agrees within fp32 noise."""
    seen = run_ranks(cuda_and_cpu_reducers, world_size=1, backend="nccl", timeout_s=300)[0]
    cuda, cpu = seen["cuda"], seen["cpu"]
    assert cuda["error_places"] == {"device": {("cuda", False)}, "host": {("cpu", True)}}
    for got_device, got_host in zip(cuda["outputs"]["device"], cuda["outputs"]["host"]):
        for name in SHAPES:
            assert torch.equal(got_device[name], got_host[name]), name
    for key in ("dense", "device"):
        for got, want in zip(cuda["outputs"][key], cpu["outputs"][key]):
            for name in SHAPES:
                torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4)


def test_torch_adamw_on_cuda_is_torch_own_step():
    """nshard's chunked step leaves CUDA tensors to torch's AdamW: the same bits as an unwrapped twin."""
    from nshard.seam.chunked_adamw import chunk_steps

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 70, generator=gen).cuda()) for _ in range(2)]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(twin, lr=1e-2)
    chunk_steps(ours, 1024)
    for _ in range(3):
        for p, q in zip(params, twin):
            p.grad = torch.randn(p.shape, generator=gen).cuda()
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin))


def evaluate(run_dir, out) -> dict:
    proc = subprocess.run([sys.executable, "-m", "nshard.study.evaluate", "--run", str(run_dir), "--model",
                           str(run_dir / "model"), "--label", "cuda", "--out", str(out), "--exploratory"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_trains_exports_and_evaluates_on_cuda(tmp_path, bf16):
    out = tmp_path / "run"
    launch(out, tiny_config(bf16=bf16), world=1, cuda=True)
    (receipt,) = receipts(out)
    assert receipt["device"] == "cuda:0" and receipt["link"]["backend"] == "nccl"
    assert receipt["optimizer"]["basic"] == "AdamW"
    assert receipt["optimizer"]["wrapper"] == ("FP16_UnfusedOptimizer" if bf16 else "AdamW")
    assert set(receipt["gpu_memory_by_phase"]) == {"setup", "updates", "export"}
    assert len(receipt["update_peak_allocated_bytes"]) == receipt["updates"]
    assert all(0 < a <= r for a, r in zip(receipt["update_peak_allocated_bytes"], receipt["update_peak_reserved_bytes"]))
    assert receipt["expandable_segments"]["requested"] is True and receipt["expandable_segments"]["in_effect"] is True
    assert receipt["determinism"]["deterministic_algorithms"] is False
    summary = evaluate(out, tmp_path / "eval")
    assert (summary["device"], summary["dtype"]) == ("cuda:0", "bfloat16" if bf16 else "float32")
    assert summary["cases"] > 0


def test_fused_adam_opt_in_trains_like_torch_adamw(tmp_path):
    """optimizer.params.torch_adam=false hands the step to DeepSpeed's FusedAdam (compiled with nvcc at first
    use): the weights stay within fp32 noise of torch's AdamW over the same run."""
    fused = tiny_config()
    fused["optimizer"]["params"]["torch_adam"] = False
    launch(tmp_path / "fused", fused, world=1, cuda=True)
    launch(tmp_path / "torch", tiny_config(), world=1, cuda=True)
    assert receipts(tmp_path / "fused")[0]["optimizer"]["basic"] == "FusedAdam"
    ours, theirs = final_params(tmp_path / "fused"), final_params(tmp_path / "torch")
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-3, atol=1e-5)


def test_deterministic_cuda_runs_repeat_bit_for_bit(tmp_path):
    plan = tmp_path / "deterministic.toml"
    plan.write_text((REPO / "launch/plans/tiny.toml").read_text() + "\n[checkpoint]\ndeterministic_cuda = true\n")
    roots = []
    for name in ("first", "second"):
        launch(tmp_path / name, copy.deepcopy(tiny_config()), world=1, plan=plan, cuda=True)
        (receipt,) = receipts(tmp_path / name)
        assert receipt["determinism"] == {"requested": True, "cuda": True, "deterministic_algorithms": True,
                                          "cublas_workspace_config": ":4096:8"}
        roots.append(receipt["parameter_root"])
    assert roots[0] == roots[1]


def summed_against_in_buffer(rank: int, world: int, device_type: str = "cuda") -> dict:
    """PowerSGD on CUDA tensors two ways, fed the same gradients: reduce() in the gradients' buffers, and the
    ingest seam's path (each matrix summed into error_sums(), reduce_summed(), outputs one by one: SummedUpdate),
    both delivering bf16 as a bf16 run does. Returns each way's outputs, errors, Q and ledger. (device_type "cpu"
    runs the same comparison on the CPU, where tests/test_comm_powersgd.py already makes it.)"""
    from nshard.comm import build_reducer

    cuda = torch.device(device_type, rank if device_type == "cuda" else None)
    ways = {way: build_reducer({**CONFIG, "error_feedback": "device"}) for way in ("buffer", "summed")}
    found = {way: {"outputs": []} for way in ways}
    for reducer in ways.values():
        reducer.register(SHAPES)
        reducer.deliver_as({name: torch.bfloat16 for name in SHAPES})
    for update in range(4):
        grads = {n: g.to(cuda) for n, g in grads_for(rank, update).items()}
        ways["buffer"].reduce(grads)
        found["buffer"]["outputs"].append({n: g.cpu() for n, g in grads.items()})
        grads = {n: g.to(cuda) for n, g in grads_for(rank, update).items()}
        sums = ways["summed"].error_sums(cuda)
        for name, target in sums.items():
            target.add_(grads[name])
        summed = ways["summed"].reduce_summed({n: g for n, g in grads.items() if n not in sums})
        outputs = {n: g.cpu() for n, g in grads.items() if n not in sums}
        outputs.update({name: summed.output(name).to("cpu", copy=True) for name in sorted(sums)})  # before finish()
        summed.finish()
        found["summed"]["outputs"].append(outputs)
    for way, reducer in ways.items():
        state = reducer.state_dict()
        found[way].update(errors={n: e.cpu() for n, e in state["errors"].items()},
                          q={n: q.cpu() for n, q in state["q"].items()}, ledger=reducer.ledger.records,
                          places={e.device.type for e in state["errors"].values()})
    return found


def test_summed_update_on_cuda_gives_the_in_buffer_bits():
    """SummedUpdate (ZeRO-1/2 and bf16's ingest path) on CUDA tensors: bit-identical outputs, errors and Q to reduce()
    in the gradients' buffers, with the error memory on the GPU and updates compressed after the warm-up."""
    seen = run_ranks(summed_against_in_buffer, world_size=1, backend="nccl", timeout_s=300)[0]
    buffer, summed = seen["buffer"], seen["summed"]
    assert buffer["places"] == summed["places"] == {"cuda"}
    assert sum(r["compressed"] for r in summed["ledger"]) == 4 - CONFIG["dense_warmup_updates"] > 0
    assert summed["ledger"] == buffer["ledger"]
    for got, want in zip(summed["outputs"], buffer["outputs"], strict=True):
        assert all(torch.equal(got[n], want[n]) for n in SHAPES)
    assert all(torch.equal(summed["errors"][n], buffer["errors"][n]) for n in buffer["errors"])
    assert all(torch.equal(summed["q"][n], buffer["q"][n]) for n in buffer["q"])


@pytest.mark.parametrize("config_name", list(GPU_CHECK_POWERSGD))
def test_the_gpu_checks_powersgd_paths_train_on_cuda(tmp_path, config_name):
    """bf16 at stage 0 through nshard's reducer, ZeRO-2 bf16 with 4-bit delta sync, ZeRO-1 fp32 summing microbatches
    into the error memory: launch/gpu_check.sh's ds_configs on the tiny model (rank 4, so it compresses), one NCCL
    rank; the receipts pass every check the GPU check makes (compressed updates, delta syncs, error sums, device)."""
    check = gpu_check()
    step = next(s for s in check.steps(tmp_path, check.write_inputs(tmp_path))
                if s.name == GPU_CHECK_POWERSGD[config_name])
    receipt, metrics = tiny_step_run(tmp_path, config_name, rank=4, cuda=True)
    held, failed = check.training_checks(step.expect, receipt, metrics, 3, cuda=True)
    assert failed == [], failed
