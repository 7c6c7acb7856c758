"""nshard.overlap_backward: the reduction started bucket by bucket during the last backward gives the same bits as
the reduction after it (dense and PowerSGD, device and host error memory, on two gloo ranks, both modes in one run),
the same ledger, replicas that agree, and a wait after backward that is counted as collective_wait."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from spawn import run_ranks

UPDATES, MICROBATCHES, BUCKET_BYTES = 5, 2, 1024
POWERSGD = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 2, "min_compression_rate": 1,
            "warm_start": True, "seed": 3, "transport": "torch"}
KINDS = {"dense": {"reducer": "dense"}, "device": {**POWERSGD, "error_feedback": "device"},
         "host": {**POWERSGD, "error_feedback": "host"}}


class Net(torch.nn.Module):
    """Tied embedding and head, a layer used only by the first microbatch (its gradient is final before the last
    backward, which never touches it), one that rank 1 uses in every microbatch and rank 0 only in the first (its
    bucket starts inside rank 1's last backward and after rank 0's), and one never used (no gradient at all). They
    come first in module order, so in the buckets (reverse module order) they come last and do not hold the others
    back."""

    def __init__(self):
        super().__init__()
        self.never = torch.nn.Linear(3, 3)
        self.lone = torch.nn.Linear(24, 24)
        self.side = torch.nn.Linear(24, 24)
        self.emb = torch.nn.Embedding(40, 24)
        self.a = torch.nn.Linear(24, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.b = torch.nn.Linear(32, 24)
        self.head = torch.nn.Linear(24, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, first: bool, rank: int) -> torch.Tensor:
        h = self.emb(ids)
        if first:
            h = h + self.side(h)
        if first or rank == 1:
            h = h + self.lone(h)
        logits = self.head(self.b(self.norm(self.a(h)).relu()))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 40), ids.roll(1, dims=1).reshape(-1))


def microbatch(rank: int, update: int, step: int) -> torch.Tensor:
    return torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(100 * update + 10 * step + rank))


def train(rank: int, kind: str, overlap: bool, delay_s: float = 0.0):
    """UPDATES updates of MICROBATCHES each, reduced after the last backward or during it; SGD steps. Returns
    each update's reduced gradients, the reducer's numerical state and ledger, the final parameters, and how many
    buckets started inside the backward."""
    from nshard.comm import build_reducer
    from nshard.comm.overlap import BackwardOverlap

    torch.manual_seed(0)
    model = Net()
    params = dict(model.named_parameters())
    reducer = build_reducer(KINDS[kind])
    reducer.register({n: p.shape for n, p in params.items()})
    driver = BackwardOverlap(reducer, params, bucket_bytes=BUCKET_BYTES) if overlap else None
    grads, in_backward = [], []
    for update in range(UPDATES):
        for step in range(MICROBATCHES):
            loss = model(microbatch(rank, update, step), first=step == 0, rank=rank)
            if step < MICROBATCHES - 1:
                loss.backward()
            elif driver is not None:
                time.sleep(delay_s)
                driver.reduce(loss.backward)
                in_backward.append(driver.launched_in_backward)
            else:
                loss.backward()
                for p in params.values():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                reducer.reduce({n: p.grad for n, p in params.items()})
        grads.append({n: p.grad.clone() for n, p in params.items()})
        with torch.no_grad():
            for p in params.values():
                p.sub_(0.1 * p.grad)
                p.grad.zero_()  # as DeepSpeed's stage-0 zero_grad does under nshard (keep_gradients_in_place)
    sd = reducer.state_dict()
    state = copy.deepcopy({k: sd[k] for k in ("errors", "q", "rng") if k in sd})
    return {"grads": grads, "state": state, "ledger": reducer.ledger.records, "updates": reducer.updates,
            "params": {n: p.detach().clone() for n, p in params.items()}, "in_backward": in_backward,
            "buckets": len(driver.buckets) if driver else None}


def both_modes(rank: int, world: int) -> dict:
    return {kind: {"plain": train(rank, kind, False), "overlap": train(rank, kind, True)} for kind in KINDS}


def equal(a, b) -> bool:
    """Bit-equal nested dicts/lists of tensors (a NaN-free comparison of the same bits)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def trained():
    return run_ranks(both_modes, 2, timeout_s=300)


@pytest.mark.parametrize("kind", list(KINDS))
def test_overlapped_reduction_is_bit_identical_to_the_reduction_after_backward(trained, kind):
    for rank, by_kind in enumerate(trained):
        plain, overlap = by_kind[kind]["plain"], by_kind[kind]["overlap"]
        for update, (g_plain, g_overlap) in enumerate(zip(plain["grads"], overlap["grads"])):
            for name in g_plain:
                assert equal(g_plain[name], g_overlap[name]), (kind, rank, update, name)
        assert equal(plain["state"], overlap["state"]), (kind, rank, "errors, Q or RNG differ")
        assert equal(plain["params"], overlap["params"]), (kind, rank)
        assert plain["ledger"] == overlap["ledger"] and plain["updates"] == overlap["updates"] == UPDATES


@pytest.mark.parametrize("kind", list(KINDS))
def test_replicas_agree_and_the_update_really_reduced(trained, kind):
    zero, one = trained[0][kind]["overlap"], trained[1][kind]["overlap"]
    # The ranks fed different data (microbatch() depends on the rank): what they hold in common is the reduction's.
    assert not torch.equal(microbatch(0, 0, 1), microbatch(1, 0, 1))
    assert equal(zero["grads"], one["grads"]) and equal(zero["params"], one["params"]), kind
    # Q and the generator are replicated; the error memory is each rank's own.
    assert equal({k: v for k, v in zero["state"].items() if k != "errors"},
                 {k: v for k, v in one["state"].items() if k != "errors"}), kind
    if kind != "dense":
        compressed = [r for r in zero["ledger"] if r["compressed"]]
        assert len(compressed) == UPDATES - POWERSGD["dense_warmup_updates"] and all(r["bytes"]["p"] for r in compressed)
        assert zero["state"]["errors"] and any(e.abs().sum() > 0 for e in zero["state"]["errors"].values())


def test_buckets_start_during_backward_and_the_unused_ones_after_it(trained):
    for by_kind in trained:
        for kind in KINDS:
            run = by_kind[kind]["overlap"]
            # never: the last bucket, never final inside the last backward; side and lone (on rank 0) before it.
            assert run["buckets"] >= 4 and all(2 <= n < run["buckets"] for n in run["in_backward"]), (kind, run)


class StepEngine:
    """What InPlaceSeam asks of DeepSpeed's engine at stage 0: the module, a backward and an SGD step."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def backward(self, loss, scale_wrt_gas: bool) -> None:
        loss.backward()

    def step(self) -> None:
        with torch.no_grad():
            for p in self.module.parameters():
                p.sub_(0.1 * p.grad)
                p.grad.zero_()


def phase_scenario(rank: int, world: int) -> dict:
    """One compressed overlapped update through the stage-0 seam (nshard/seam/reduction.py InPlaceSeam
    backward_and_step) inside the clock's microbatch, as train_update runs it. Rank 0's forward takes 0.15 s (a
    sleep), rank 1's 0.55 s: rank 0's wait for rank 1 after its own backward, about 0.4 s, must be collective_wait,
    and its forward inside the microbatch's forward_backward."""
    from nshard.phases import CLOCK

    from nshard.comm import build_reducer
    from nshard.seam.reduction import InPlaceSeam

    torch.manual_seed(0)
    model = Net()
    engine = StepEngine(model)
    seam = InPlaceSeam(engine, build_reducer({**POWERSGD, "dense_warmup_updates": 0}), "powersgd", overlap=True)
    CLOCK.start()
    start = time.perf_counter()
    with CLOCK.microbatch():
        loss = model(microbatch(rank, 0, 0), first=False, rank=rank)
        time.sleep(0.55 if rank == 1 else 0.15)
        seam.backward_and_step(engine, loss, last=True)
    update_s = time.perf_counter() - start
    return {"update_s": update_s, **CLOCK.stop(update_s)}


def test_the_wait_after_backward_is_collective_wait_and_no_time_escapes_the_phases():
    zero, one = run_ranks(phase_scenario, 2, timeout_s=120)
    phases = zero["phases"]
    # `rest` is the update's time no phase claims (PhaseClock.stop: the remainder, so the phases always sum to the
    # update): here only the perf_counter calls around the microbatch, far under the 0.15 s forward.
    assert 0 <= phases["rest"] <= 0.02 * zero["update_s"], phases
    assert phases["forward_backward"] >= 0.15, phases
    assert phases["collective_wait"] >= 0.3, phases  # rank 1 came 0.4 s late
    assert phases["optimizer_step"] > 0, phases
    assert phases["forward_backward"] < 0.3 and phases["reducer_compute"] < 0.3, phases
    assert zero["detail"]["powersgd_pq"] > 0 and one["detail"]["powersgd_pq"] > 0


def test_plan_buckets_cuts_in_order_and_a_large_parameter_is_alone():
    from nshard.comm.overlap import plan_buckets

    sizes = [("c", 10), ("b", 40), ("a", 5), ("z", 5), ("y", 1)]
    assert plan_buckets(sizes, 12) == (("c",), ("b",), ("a", "z", "y"))
    assert plan_buckets([("c", 10), ("b", 12), ("a", 3)], 12) == (("c",), ("b",), ("a",))  # at least: alone too
    assert plan_buckets(sizes, 1) == tuple((n,) for n, _ in sizes)
    assert plan_buckets(sizes, 10**6) == (("c", "b", "a", "z", "y"),)


class LoopTransport:
    """One rank that starts nothing: records which all-reduces were started and which were waited for."""

    world_size = 1

    def __init__(self):
        self.started, self.waited = [], []

    def all_gather_object(self, obj) -> list:
        return [obj]

    def all_reduce_sum_(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def start_all_reduce_sum_(self, tensor: torch.Tensor):
        self.started.append(len(self.started))
        return self.started[-1], tensor.numel() * tensor.element_size()

    def wait(self, handle) -> None:
        self.waited.append(handle)


class Boom(Exception):
    pass


def test_a_failed_backward_waits_for_its_buckets_and_an_open_update_refuses_another():
    from nshard.comm.dense import DenseReducer
    from nshard.comm.overlap import BackwardOverlap

    transport = LoopTransport()
    model = Net()
    params = dict(model.named_parameters())
    reducer = DenseReducer(transport)
    reducer.register({n: p.shape for n, p in params.items()})
    driver = BackwardOverlap(reducer, params, bucket_bytes=BUCKET_BYTES)
    loss = model(microbatch(0, 0, 0), first=False, rank=0)

    def failing_backward():
        loss.backward()  # the hooks start the buckets whose gradients are final
        raise Boom()

    with pytest.raises(Boom):
        driver.reduce(failing_backward)
    assert len(transport.started) >= 2 and transport.waited == transport.started  # none left in flight
    assert reducer.updates == 0 and not reducer.ledger.records  # nothing recorded of the failed update
    driver.begin(lambda name: params[name].grad)  # the failed update is closed: the next one may begin
    with pytest.raises(RuntimeError, match="an update was begun while the previous one is still open"):
        driver.begin(lambda name: params[name].grad)


def test_buckets_are_sized_by_the_fp32_bytes_sent_not_the_parameter_dtype():
    from nshard.comm.dense import DenseReducer
    from nshard.comm.overlap import BackwardOverlap

    params = {n: torch.zeros(256, dtype=torch.bfloat16) for n in ("a", "b")}  # 512 bf16 bytes, 1024 fp32 bytes
    reducer = DenseReducer(LoopTransport())
    reducer.register({n: p.shape for n, p in params.items()})
    assert BackwardOverlap(reducer, params, bucket_bytes=1024).buckets == (("b",), ("a",))


@pytest.mark.parametrize("section,message", [
    ({"overlap_backward": "yes"}, "nshard.overlap_backward is 'yes'; set it to true or false"),
    ({"overlap_backward": True, "transport": "mpi"}, "nshard.overlap_backward is true with transport 'mpi'"),
    ({"overlap_backward": True, "microbatch_sums": "error"},
     'nshard.overlap_backward is true with microbatch_sums "error"'),
])
def test_a_bad_overlap_setting_is_one_error_naming_the_key(section, message):
    from nshard.comm.config import ConfigError, parse_config
    from nshard.seam.ds_config import DsConfigError, reducer_config

    assert parse_config({}).overlap_backward is False
    assert parse_config({"overlap_backward": True}).overlap_backward is True
    with pytest.raises(ConfigError, match=message):
        parse_config(section)
    with pytest.raises(DsConfigError, match=message):  # before any process starts
        reducer_config({"nshard": section})


def test_overlap_on_a_cuda_device_is_refused_before_the_reducer_is_built():
    """On CUDA the phase clock synchronizes at every phase boundary, so nothing would overlap: refused by name."""
    import types

    from nshard.comm.config import ConfigError, check_device, parse_config
    from nshard.seam.engine import install_reducer

    overlap = parse_config({"overlap_backward": True})
    check_device(overlap, "cpu")
    check_device(parse_config({}), "cuda")
    message = "nshard.overlap_backward is true on a CUDA device: .*set overlap_backward to false"
    with pytest.raises(ConfigError, match=message):
        check_device(overlap, "cuda")
    with pytest.raises(ConfigError, match=message):  # the seam's installer, which knows the engine's device
        install_reducer(types.SimpleNamespace(device=torch.device("cuda", 0)), overlap)


SECTION = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1, "min_compression_rate": 2,
           "error_feedback": "device", "warm_start": True, "seed": 0, "transport": "torch"}


def metrics(out):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(plain, overlap) -> None:
    """The same weights, parameter roots on every rank of both runs, and bytes, update by update."""
    from runs import final_params, receipts

    assert equal(final_params(plain), final_params(overlap))
    roots = {r["parameter_root"] for out in (plain, overlap) for r in receipts(out)}
    assert len(roots) == 1, roots
    for a, b in zip(metrics(plain), metrics(overlap), strict=True):
        assert (a["compressed"], a["reducer_bytes"], a["logged_reducer_bytes"]) == \
               (b["compressed"], b["reducer_bytes"], b["logged_reducer_bytes"])
        assert b["phases"]["collective_wait"] > 0
    assert any(m["compressed"] for m in metrics(overlap))
    # The receipts say which started the reduction during the backward, with every update of the run counted.
    updates = len(metrics(overlap))
    for r in receipts(plain):
        assert r["reduction_ran"]["overlap_backward"] is None
    for r in receipts(overlap):
        record = r["reduction_ran"]["overlap_backward"]
        assert record["buckets"] >= 1 and record["updates"] == updates
        assert 0 <= record["started_in_backward"] <= updates * record["buckets"]


@pytest.mark.slow
def test_a_deepspeed_run_with_overlap_trains_the_same_bits(runs_root):
    """The tiny plan at stage 0 in fp32 (the .grad path) under PowerSGD with one dense warm-up update."""
    from runs import cached_run, tiny_config

    # test_reducer_engine.py's stage-0 run, the same name and configuration: one launch serves both files
    plain = cached_run(runs_root, "psgd-z0", tiny_config(stage=0, nshard=SECTION))
    overlap = cached_run(runs_root, "psgd-z0-overlap", tiny_config(stage=0, nshard={**SECTION, "overlap_backward": True}))
    assert_same_training(plain, overlap)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bf16-stage0", "zero2-one-microbatch"])
def test_the_ingest_seam_with_overlap_trains_the_same_bits(runs_root, case):
    """The ingest seam: bf16 at stage 0 (two microbatches, fp32 sums, the hand-over through DeepSpeed's hooks),
    and ZeRO-2 with one microbatch per update, where without overlap the gradients go straight into the error
    memory and with it into fp32 sums (0 + g is g: the same M)."""
    from runs import REPO, cached_run, launch, tiny_config

    plan = REPO / "launch/plans/tiny.toml"
    overlap = runs_root / f"overlap-{case}"
    if case == "bf16-stage0":
        config = lambda section: tiny_config(stage=0, nshard=section, bf16=True)
        plain = cached_run(runs_root, "psgd-z0-bf16", config(SECTION))  # test_reducer_engine.py's bf16 run
    else:
        plan = runs_root / "tiny-one-microbatch-overlap.toml"
        plan.write_text((REPO / "launch/plans/tiny.toml").read_text().replace("microbatch_docs = 2",
                                                                             "microbatch_docs = 3"))
        config = lambda section: tiny_config(stage=2, nshard=section)
        plain = runs_root / f"overlap-{case}-plain"
        launch(plain, config(SECTION), plan=plan)
    launch(overlap, config({**SECTION, "overlap_backward": True}), plan=plan)
    assert_same_training(plain, overlap)
    assert {m["microbatch_sums"] for m in metrics(plain)} == \
           {"error memory" if case == "zero2-one-microbatch" else "fp32 sums"}
    assert {m["microbatch_sums"] for m in metrics(overlap)} == {"fp32 sums"}


@pytest.mark.slow
def test_the_benchmark_prints_both_modes_in_one_run(tmp_path):
    """launch/bench_overlap.py's smoke test: the tiny model on this machine's loopback (no hosts, no root)."""
    import json
    import subprocess
    import sys

    from runs import REPO

    proc = subprocess.run([sys.executable, "-m", "launch.bench_overlap", "--link", "local", "--model", "tiny",
                           "--updates", "1", "--cores", "0", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_overlap.json").read_text())
    assert report["command"] == f".venv/bin/python -m launch.bench_overlap --link local --model tiny --updates 1 " \
                                f"--cores 0 --out {tmp_path}"
    assert set(report["arms"]) == {"dense", "dense+overlap", "powersgd", "powersgd+overlap"}
    assert set(report["old_over_new"]) == {"dense", "powersgd"} and "old / new" in proc.stdout
    for arm in ("dense", "powersgd"):
        assert report["arms"][arm]["bytes_per_update"] == report["arms"][f"{arm}+overlap"]["bytes_per_update"]
        assert report["arms"][f"{arm}+overlap"]["buckets_started_in_backward"]


def test_the_benchmark_records_its_command_as_it_can_be_rerun():
    from launch.bench_overlap import command_line

    assert command_line(["--link", "1gbit", "--out", "runs/bench overlap"]) == \
        ".venv/bin/python -m launch.bench_overlap --link 1gbit --out 'runs/bench overlap'"


def test_the_report_says_when_each_arm_started_its_reduction():
    from analysis.report import StudyError, reduction_start_of

    def receipt(overlap):
        return {"reduction_ran": {"configured": "dense", "overlap_backward": overlap}}

    assert reduction_start_of([receipt(None), receipt(None)]) == "after the last backward"
    during = [receipt({"buckets": 4, "updates": 3, "started_in_backward": 9}),
              receipt({"buckets": 4, "updates": 3, "started_in_backward": 6})]
    assert reduction_start_of(during) == "during the last backward: 4 buckets, 62% started before it ended"
    assert reduction_start_of([{"reduction_ran": {"configured": "dense"}}]) is None  # a receipt before the record
    assert reduction_start_of([{"reduction_ran": {"configured": "deepspeed"}}] * 2) == "DeepSpeed's own reduction"
    with pytest.raises(StudyError, match="started the reduction differently"):
        reduction_start_of([receipt(None), during[0]])
