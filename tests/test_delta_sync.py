"""Delta parameter sync (nshard/comm/delta.py): ZeRO-1/2's end-of-step all-gather sent as quantized master − replica.

The codec's bound and packing on one process, the same bits at any chunk size, no host read on a GPU-sized chunk;
the ring on two real gloo ranks (replicas bit-identical, bytes as the formula), NCCL's batched exchange and
all_gather close on gloo against the ring; real DeepSpeed runs at ZeRO-1 and ZeRO-2, fp32 and bf16 (replicas agree at
every check, the export holds the masters, the gap stays small, nshard's byte count against the comms logger's);
NCCL's transport with the comms logger off ends bit-identical to the ring; kill/resume with delta sync on ends
bit-identical; refused ds_configs.
"""

import json

import pytest
import torch

from nshard.comm.config import ConfigError, parse_config
from nshard.comm.delta import (CHUNK_BLOCKS, GPU_CHUNK_ELEMENTS, DeltaCodec, chunk_elements, delta_sync_, gap_max_,
                                max_gap)
from nshard.run.state import StateError, find_resumable, sealed_states
from nshard.seam.ds_config import DsConfigError, reducer_config
from runs import REPO, cached_run, final_params, launch, receipts, tiny_config
from spawn import run_ranks

POWERSGD = {"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1}


def delta(bits: int = 4, **more) -> dict:
    return {**POWERSGD, "parameter_sync": "delta", "delta_bits": bits, **more}


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The wider of the two spacings of x's dtype at each element of x (they differ at powers of two), in float64."""
    up = torch.nextafter(x, torch.full_like(x, float("inf"))).double() - x.double()
    down = x.double() - torch.nextafter(x, torch.full_like(x, float("-inf"))).double()
    return torch.maximum(up.abs(), down.abs())


def block_scales(codec: DeltaCodec, delta64: torch.Tensor) -> torch.Tensor:
    """Each element's quantization step (its block's max |Δ| / qmax), recomputed in float64."""
    n = delta64.numel()
    padded = torch.zeros(codec.blocks(n) * codec.block, dtype=torch.float64)
    padded[:n] = delta64
    steps = padded.view(-1, codec.block).abs().amax(dim=1) / codec.qmax
    return steps.repeat_interleave(codec.block)[:n]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gap_never_exceeds_half_a_step_plus_half_an_ulp(bits, dtype):
    codec = DeltaCodec(bits=bits, block=64)
    g = torch.Generator().manual_seed(bits)
    n = 10_007  # not a multiple of the block: the padded tail must decode to nothing
    master = torch.randn(n, generator=g)
    replica = (master + 1e-3 * torch.randn(n, generator=g)).to(dtype)
    master[:64] = replica[:64].float()  # a block with no change: scale 0, nothing moves
    before = replica.clone()
    encoded = codec.empty(n, "cpu")
    codec.encode(master, replica, encoded)
    assert encoded.numel() == codec.encoded_bytes(n) == codec.blocks(n) * (64 * bits // 8 + 4)
    codec.apply_(replica, encoded)
    gap = (master.double() - replica.double()).abs()
    step = block_scales(codec, master.double() - before.double())
    # fp32 rounding of Δ/scale and of q·scale adds a few fp32 ulps of Δ at most
    slack = 4 * torch.finfo(torch.float32).eps * (master.double() - before.double()).abs()
    assert bool((gap <= step / 2 + ulp(replica) / 2 + slack).all())
    assert torch.equal(replica[:64], before[:64])
    assert max_gap(master, replica) == pytest.approx(float(gap.max()))


def test_the_gap_is_the_error_memory_carried_into_the_next_delta():
    """A master that stops moving is reached by the replica step after step: what one step's quantization left
    out is in the next Δ, with no buffer holding it."""
    codec = DeltaCodec(bits=2, block=32)
    g = torch.Generator().manual_seed(0)
    master = torch.randn(4096, generator=g)
    replica = master + 1e-2 * torch.randn(4096, generator=g)
    gaps = []
    for _ in range(40):
        encoded = codec.empty(master.numel(), "cpu")
        codec.encode(master, replica, encoded)
        codec.apply_(replica, encoded)
        gaps.append(max_gap(master, replica))
    assert gaps[-1] < gaps[0] / 1000 and all(b <= a for a, b in zip(gaps, gaps[1:]))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_every_level_packs_and_decodes_exactly(bits):
    """Changes that are whole multiples of the scale (every level from -qmax to +qmax) are carried exactly:
    packing, the decode table and the multiply lose nothing, so the replica lands on the master."""
    codec = DeltaCodec(bits=bits, block=16)
    levels = torch.arange(-codec.qmax, codec.qmax + 1, dtype=torch.float32)
    change = levels.repeat(-(-160 // levels.numel()))[:160]
    change[::16] = codec.qmax  # every block's largest |change| is qmax, so its scale is exactly 1
    replica = torch.zeros(160)
    master = replica + change
    encoded = codec.empty(160, "cpu")
    codec.encode(master, replica, encoded)
    codec.apply_(replica, encoded)
    assert torch.equal(replica, master)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_whole_number_of_blocks_per_chunk_gives_the_same_bits(dtype):
    """The CPU's cache-sized chunks, a GPU's whole-partition chunk and an odd three-block chunk, on the same partition
    in this run: the same encoded bytes, the same replicas after applying them, the same gap."""
    codec = DeltaCodec(bits=4, block=64)
    n = 2 * CHUNK_BLOCKS * 64 + 1_001  # three CPU chunks, the last one ragged
    g = torch.Generator().manual_seed(3)
    master = torch.randn(n, generator=g)
    start = (master + 1e-3 * torch.randn(n, generator=g)).to(dtype)
    results = []
    for chunk in (None, -(-n // 64) * 64, 3 * 64):  # None: chunk_elements("cpu"), CHUNK_BLOCKS blocks
        encoded, replica = codec.empty(n, "cpu"), start.clone()
        codec.encode(master, replica, encoded, chunk=chunk)
        codec.apply_(replica, encoded, chunk=chunk)
        gap = gap_max_(torch.zeros(()), master, replica, chunk=chunk)
        results.append((encoded, replica, gap))
    for encoded, replica, gap in results[1:]:
        assert torch.equal(encoded, results[0][0]) and torch.equal(replica, results[0][1])
        assert torch.equal(gap, results[0][2])
    # The gap as the old per-chunk host reads computed it (aminmax of each chunk, read back chunk by chunk).
    old = max(max(float(hi), -float(lo)) for lo, hi in (torch.aminmax(torch.sub(m.float(), r.float()))
              for m, r in zip(master.split(CHUNK_BLOCKS * 256), results[0][1].split(CHUNK_BLOCKS * 256))))
    assert float(results[0][2]) == old == max_gap(master, results[0][1])


def test_chunks_are_sized_by_device_and_a_bad_chunk_is_refused():
    assert chunk_elements("cpu", 256) == CHUNK_BLOCKS * 256
    assert chunk_elements("cuda", 256) == GPU_CHUNK_ELEMENTS and chunk_elements("cuda", 48) % 48 == 0
    codec = DeltaCodec(bits=4, block=64)
    with pytest.raises(ValueError, match="delta chunk 100: use a positive multiple of the block"):
        codec.encode(torch.zeros(128), torch.zeros(128), codec.empty(128, "cpu"), chunk=100)


def test_a_gpu_sized_partition_is_encoded_applied_and_measured_with_no_host_read():
    """On the meta device (no memory, GPU-sized chunks) any read back to the host (.item(), float(), a branch on a
    value) raises: encode, apply, delta_sync_ and the running gap read nothing; the one read is the caller's."""
    codec, n = DeltaCodec(bits=4, block=256), 3 * GPU_CHUNK_ELEMENTS + 1_000
    master = torch.empty(n, device="meta")
    replica = torch.empty(n, dtype=torch.bfloat16, device="meta")
    assert delta_sync_(codec, master, [replica]) == 0
    running = gap_max_(torch.zeros((), device="meta"), master, replica)
    assert running.device.type == "meta" and running.shape == ()
    with pytest.raises(RuntimeError, match="meta"):
        running.item()


def test_bench_delta_prints_old_and_new_with_their_host_reads(capsys):
    """launch/bench_delta.py's smoke run: both arms on a small CPU partition (said so), the same bits, the old arm
    reading the gap back twice per chunk, the new one once."""
    from launch.bench_delta import main

    summary = main(["--device", "cpu", "--numel", "2500000", "--repeats", "1", "--json"])
    assert summary["same_bits"] and summary["shrunk"]["numel"] == 2_500_000
    old, new = summary["old"], summary["new"]
    assert old["chunks"] == 3 and old["host_reads"] == 6 and new["host_reads"] == 1 and old["gap"] == new["gap"] > 0
    assert json.loads(capsys.readouterr().out) == summary


@pytest.mark.parametrize("field,value,message", [
    ("parameter_sync", "sparse", 'nshard.parameter_sync is \'sparse\'; set it to "dense" or "delta"'),
    ("delta_bits", 3, "nshard.delta_bits is 3; set it to 8, 4 or 2"),
    ("delta_block", 100, "nshard.delta_block is 100; set it to a multiple of 16"),
])
def test_bad_delta_fields_name_the_key_and_the_fix(field, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"reducer": "powersgd", field: value})


@pytest.mark.parametrize("change,message", [
    ({"zero_optimization": {"stage": 0}}, "needs stage 1 or 2"),
    ({"zero_optimization": {"stage": 2, "load_from_fp32_weights": False}}, "load_from_fp32_weights=false"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal=true"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
])
def test_ds_configs_that_would_close_the_gap_are_refused(change, message):
    config = {**tiny_config(stage=2, nshard=delta()), **change}
    with pytest.raises(DsConfigError, match=message):
        reducer_config(config)


def _ring(rank, world, bits, dtype, exchange="ring"):
    import torch.distributed as dist

    from nshard.comm.delta import exchange_batched
    from nshard.comm.ring import open_second_lane

    open_second_lane()  # a two-rank ring sends each direction on its own connection (nshard/comm/ring.py)
    codec = DeltaCodec(bits=bits, block=64)
    size = 5_000
    g = torch.Generator().manual_seed(1)
    replicas_flat = torch.randn(world * size, generator=g).to(dtype)  # the same on every rank
    replicas = [replicas_flat.narrow(0, i * size, size) for i in range(world)]
    # Each owner's master: its replica plus a step of its own.
    master = replicas[rank].float() + 5e-2 * torch.randn(size, generator=torch.Generator().manual_seed(10 + rank))
    before = max_gap(master, replicas[rank])
    sent = delta_sync_(codec, master, replicas, group=None, exchange=exchange_batched if exchange == "batched" else None)
    dist.barrier()
    return {"replicas": replicas_flat.clone(), "sent": sent, "gap_before": before,
            "gap_after": max_gap(master, replicas[rank])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_ranks_end_with_bit_identical_replicas_and_send_the_encoded_bytes(dtype):
    results = run_ranks(_ring, 2, args=(4, dtype))
    assert torch.equal(results[0]["replicas"], results[1]["replicas"])
    assert all(r["sent"] == DeltaCodec(bits=4, block=64).encoded_bytes(5_000) for r in results)
    for r in results:  # each owner's replica moved toward its master (4 bits: the gap shrinks several-fold)
        assert 0 < r["gap_after"] < r["gap_before"] / 4


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_batched_exchange_nccl_takes_lands_the_same_bits_as_the_gloo_ring(world):
    """exchange_batched (batch_isend_irecv, what NCCL runs) here on gloo, against the isend/irecv ring: two ranks
    on their two connections, three on one group. The same replicas on every rank, either way."""
    ring = run_ranks(_ring, world, args=(4, torch.float32))
    batched = run_ranks(_ring, world, args=(4, torch.float32, "batched"))
    for a, b in zip(ring, batched):
        assert torch.equal(a["replicas"], b["replicas"]) and a["sent"] == b["sent"] > 0
    assert all(torch.equal(ring[0]["replicas"], r["replicas"]) for r in ring)


def _close(rank, world, transport):
    """close_gap_ (the end of a delta-synced run, nshard/seam/patches.py) on one flat group of bf16 replicas."""
    from nshard.comm.ring import open_second_lane
    from nshard.seam.patches import close_gap_

    open_second_lane()
    size = 3_001
    replicas_flat = torch.randn(world * size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    replicas = [replicas_flat.narrow(0, i * size, size) for i in range(world)]
    master = replicas[rank].float() + 1e-2 * torch.randn(size, generator=torch.Generator().manual_seed(10 + rank))
    close_gap_(master, replicas, None, transport)
    return {"replicas": replicas_flat.clone(), "master": master}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_closing_the_gap_by_all_gather_as_nccl_does_lands_the_ring_s_bits(world):
    """close_gap_'s "batched" branch (dist.all_gather: what NCCL runs) here on gloo with CPU tensors, against the
    ring: every rank's replicas are every owner's master rounded to bf16, the same bits either way."""
    ring, gathered = (run_ranks(_close, world, args=(transport,)) for transport in ("ring", "batched"))
    want = torch.cat([r["master"].to(torch.bfloat16) for r in ring])
    for a, b in zip(ring, gathered):
        assert torch.equal(a["replicas"], want) and torch.equal(b["replicas"], want)


def test_the_delta_transport_is_chosen_by_a_setting_and_a_bad_one_is_refused(monkeypatch):
    from nshard.seam.patches import DELTA_TRANSPORT_VARIABLE, delta_transport

    monkeypatch.delenv(DELTA_TRANSPORT_VARIABLE, raising=False)
    assert (delta_transport("gloo"), delta_transport("nccl")) == ("ring", "batched")
    monkeypatch.setenv(DELTA_TRANSPORT_VARIABLE, "batched")
    assert delta_transport("gloo") == "batched"
    monkeypatch.setenv(DELTA_TRANSPORT_VARIABLE, "ring")
    with pytest.raises(ValueError, match="NSHARD_DELTA_TRANSPORT=ring needs the gloo backend"):
        delta_transport("nccl")
    monkeypatch.setenv(DELTA_TRANSPORT_VARIABLE, "nccl")
    with pytest.raises(ValueError, match="NSHARD_DELTA_TRANSPORT='nccl': set it to ring or batched"):
        delta_transport("gloo")


# ---------------------------------------------------------------- real DeepSpeed runs

CHECKED_PLAN = (REPO / "launch/plans/tiny.toml").read_text() + "\n[checkpoint]\nreplica_check_every = 1\n"


@pytest.fixture(scope="module")
def checked_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("delta-plan") / "tiny-checked.toml"
    path.write_text(CHECKED_PLAN)
    return path


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16", [(2, False), (2, True), (1, False), (1, True)])
def test_a_delta_synced_run_keeps_replicas_identical_and_exports_the_masters(runs_root, checked_plan, stage, bf16):
    """ZeRO-1 and ZeRO-2, fp32 and bf16 (DeepSpeed's ZeRO optimizer in each). Every update runs the replica check
    (replica_check_every = 1): a divergence would stop the run."""
    out = cached_run(runs_root, f"delta4-z{stage}-{'bf16' if bf16 else 'fp32'}",
                     tiny_config(stage=stage, bf16=bf16, nshard=delta(4)), plan=checked_plan)
    assert {r["optimizer"]["wrapper"] for r in receipts(out)} == {"DeepSpeedZeroOptimizer"}
    rs = receipts(out)
    assert len({r["parameter_root"] for r in rs}) == 1
    for r in rs:
        calls = r["parameter_all_gather"]["calls"]
        assert calls["delta"]["calls"] >= 3 and calls["ring"]["calls"] == calls["deepspeed"]["calls"] == 0, calls
        assert calls["delta"]["bytes_sent"] == sum(r["update_parameter_bytes"])
        assert r["parameter_all_gather"]["delta_codec"] == {"bits": 4, "block": 256}
        assert r["parameter_all_gather"]["ring_connections"] == "one per direction"  # two gloo ranks: two lanes
        assert len(r["update_delta_gap"]) == 3 and all(0 < g < 1e-2 for g in r["update_delta_gap"])
    manifest = json.loads((out / "model" / "manifest.json").read_text())
    assert manifest["weights"]["holds"].startswith("the fp32 masters")
    # The export is the masters, not the replicas the ranks compared: the gap was closed after the last state.
    assert manifest["weights"]["masters_root"] != manifest["parameter_root"] == rs[0]["parameter_root"]
    exported = final_params(out)
    assert all(t.dtype == (torch.bfloat16 if bf16 else torch.float32) for t in exported.values())
    assert [m["delta_gap_max"] for m in metrics(out)] == rs[0]["update_delta_gap"]


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_four_bits_send_an_eighth_of_the_dense_gather_and_train_like_it(runs_root, checked_plan, bf16):
    tag = "bf16" if bf16 else "fp32"
    synced = cached_run(runs_root, f"delta4-z2-{tag}", tiny_config(stage=2, bf16=bf16, nshard=delta(4)),
                        plan=checked_plan)
    dense = cached_run(runs_root, f"dense-sync-z2-{tag}", tiny_config(stage=2, bf16=bf16, nshard=POWERSGD),
                       plan=checked_plan)
    element = 2 if bf16 else 4
    for s, d in zip(receipts(synced), receipts(dense)):  # one flat group: each rank sends its partition once
        want = [DeltaCodec(4, 256).encoded_bytes(full // element) for full in d["update_parameter_bytes"]]
        assert s["update_parameter_bytes"] == want
        assert sum(want) < sum(d["update_parameter_bytes"]) * (4 / 8 / element) * 1.04  # 4 bits + scales
    a, b = final_params(synced), final_params(dense)
    for key in a:  # three updates apart by at most a few quantization steps of lr-sized changes
        torch.testing.assert_close(a[key].float(), b[key].float(), rtol=0, atol=2e-3, msg=key)


def partition_numel(dense_receipt: dict, element: int) -> list[int]:
    """Each update's partition, in elements, from a dense-synced twin run (its ring sends one partition per update)."""
    return [b // element for b in dense_receipt["update_parameter_bytes"]]


@pytest.mark.slow
def test_nshard_counts_the_delta_bytes_and_the_comms_logger_agrees_on_gloo(runs_root, checked_plan):
    """nshard's own count of delta sync's bytes (what the receipts' parameter bytes hold on every backend) is the
    codec's encoded bytes times the exchanges, and on gloo's ring DeepSpeed's comms logger saw the same bytes."""
    synced = cached_run(runs_root, "delta4-z2-fp32", tiny_config(stage=2, nshard=delta(4)), plan=checked_plan)
    dense = cached_run(runs_root, "dense-sync-z2-fp32", tiny_config(stage=2, nshard=POWERSGD), plan=checked_plan)
    for s, d in zip(receipts(synced), receipts(dense)):
        calls = s["parameter_all_gather"]["calls"]["delta"]
        exchanges = calls["calls"] * (s["world_size"] - 1)  # one flat group: one exchange per update with 2 ranks
        numel = partition_numel(d, 4)
        assert len(set(numel)) == 1 and exchanges == len(numel) == 3
        assert calls["bytes_sent"] == DeltaCodec(4, 256).encoded_bytes(numel[0]) * exchanges
        link = s["link"]
        assert link["delta_bytes"] == link["logged_delta_bytes"] == calls["bytes_sent"]
        assert link["delta_matches_logger"] is True and link["ledger_matches_logger"] is True
        assert s["parameter_all_gather"]["delta_transport"] == "ring"
        assert s["comms_logger"] == {"enabled": True, "counted": True, "set_by": "nshard",
                                     "device_sync_per_collective": False}


@pytest.mark.slow
def test_nccl_s_delta_transport_with_the_comms_logger_off_ends_bit_identical_and_counts_its_bytes(
        runs_root, checked_plan):
    """NSHARD_DELTA_TRANSPORT=batched runs what NCCL runs (batch_isend_irecv, the gap closed by all_gather) on gloo,
    and a ds_config that switches DeepSpeed's comms logger off leaves it off, as on a GPU: the same model as the
    ring's, bit for bit, and the same parameter bytes per update, from nshard's own count alone."""
    ring = cached_run(runs_root, "delta4-z2-fp32", tiny_config(stage=2, nshard=delta(4)), plan=checked_plan)
    out = runs_root / "delta4-z2-fp32-batched-unlogged"
    launch(out, {**tiny_config(stage=2, nshard=delta(4)), "comms_logger": {"enabled": False}}, plan=checked_plan,
           env={"NSHARD_DELTA_TRANSPORT": "batched"})
    for b, r in zip(receipts(out), receipts(ring)):
        assert b["parameter_all_gather"]["delta_transport"] == "batched"
        assert "delta_log_name" not in b["parameter_all_gather"]
        assert b["comms_logger"] == {"enabled": False, "counted": False, "set_by": None,
                                     "device_sync_per_collective": False}
        assert b["update_parameter_bytes"] == r["update_parameter_bytes"]
        assert b["parameter_all_gather"]["calls"]["delta"] == r["parameter_all_gather"]["calls"]["delta"]
        assert b["update_delta_gap"] == r["update_delta_gap"] and b["parameter_root"] == r["parameter_root"]
        link = b["link"]
        assert link["logged_reducer_bytes"] is None and link["ledger_matches_logger"] is None
        assert link["logged_delta_bytes"] is None and link["delta_bytes"] == sum(b["update_parameter_bytes"])
    got, want = final_params(out), final_params(ring)  # the masters, gathered by all_gather vs the ring
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_comms_logger_is_nshard_s_only_where_it_does_not_wait_for_the_device(monkeypatch):
    from nshard.seam import patches

    monkeypatch.setattr(patches, "COMMS_LOGGER", {"asked": None, "device_syncs": None})
    assert patches.comms_logger_config({}, device_syncs=False) == {"comms_logger": patches.LOGGER_BLOCK_NSHARD_SETS}
    assert patches.COMMS_LOGGER == {"asked": False, "device_syncs": False}
    assert patches.comms_logger_config({}, device_syncs=True) == {}  # a GPU: off, no collective waits for it
    assert patches.COMMS_LOGGER == {"asked": False, "device_syncs": True}
    asked = {"comms_logger": {"enabled": True, "prof_all": True}}
    assert patches.comms_logger_config(dict(asked), device_syncs=True) == asked  # the user's, as written
    assert patches.COMMS_LOGGER == {"asked": True, "device_syncs": True}
    # DeepSpeed would switch the logger on for this block (any block enables it): off means no block.
    assert patches.comms_logger_config({"comms_logger": {"enabled": False}}, device_syncs=False) == {}
    assert patches.COMMS_LOGGER == {"asked": False, "device_syncs": False}


class Taken:
    """Bytes since the last take(), as nshard.seam.patches.CollectiveCounter hands them to the link count."""

    def __init__(self, *takes):
        self.takes = list(takes)

    def take(self):
        return self.takes.pop(0)


def test_the_link_count_uses_the_ledger_with_the_logger_off_and_flags_delta_bytes_the_logger_disputes(monkeypatch):
    from nshard.run import netcount

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    kernel = iter([0, 1500, 0, 1500])
    monkeypatch.setattr(netcount, "tx_bytes", lambda name: next(kernel))
    off = {"deepspeed_grad_bytes": 0, "logged_reducer_bytes": None, "other_bytes": 500, "delta_bytes": 500,
           "logged_delta_bytes": None}
    link = netcount.LinkCount(Taken({}, off)).finish(0, 2, 1000)["link"]  # reducer: the ledger's 1000 bytes
    assert link["logged_collective_bytes"] == 1500 and link["agree"] is True
    assert link["ledger_matches_logger"] is None and link["delta_matches_logger"] is None
    disputed = {**off, "logged_reducer_bytes": 1000, "logged_delta_bytes": 496}
    link = netcount.LinkCount(Taken({}, disputed)).finish(0, 2, 1000)["link"]
    assert link["ledger_matches_logger"] is True and link["delta_matches_logger"] is False and link["agree"] is False


@pytest.mark.slow
def test_delta_sync_off_leaves_the_dense_gather_as_it_was(runs_root, checked_plan):
    dense = cached_run(runs_root, "dense-sync-z2-fp32", tiny_config(stage=2, nshard=POWERSGD), plan=checked_plan)
    for r in receipts(dense):
        calls = r["parameter_all_gather"]["calls"]
        assert calls["delta"]["calls"] == 0 and calls["ring"]["calls"] == 3 and r["update_delta_gap"] == []
    assert "weights" not in json.loads((dense / "model" / "manifest.json").read_text())


RESUME_PLAN = (REPO / "launch/plans/tiny.toml").read_text().replace("updates = 3", "updates = 6") + (
    "\n[checkpoint]\nevery = 2\nreplica_check_every = 1\n")


@pytest.mark.slow
def test_a_killed_delta_synced_zero2_run_resumes_bit_identical(runs_root, tmp_path):
    plan = tmp_path / "resume.toml"
    plan.write_text(RESUME_PLAN)
    config = tiny_config(stage=2, nshard=delta(4))
    whole = runs_root / "delta-resume-whole"
    launch(whole, config, plan=plan)
    out = runs_root / "delta-resume-killed"
    killed = launch(out, config, plan=plan, check=False, env={"NSHARD_FAULT": "1:3"})
    assert killed.returncode != 0
    launch(out, config, plan=plan, extra_args=["--resume"])
    run, ref = (json.loads((d / "run.json").read_text()) for d in (out, whole))
    assert run["resumed_from_update"] == 2 and run["parameter_root"] == ref["parameter_root"]
    got, want = final_params(out), final_params(whole)  # the masters: restored from each rank's ZeRO file
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [r["update_delta_gap"] for r in receipts(out)] == [r["update_delta_gap"] for r in receipts(whole)]
    # A state without a rank's ZeRO file (its masters) would be loaded with the masters set from the replicas:
    # no such state verifies, and the refusal names the file.
    for state in sealed_states(out):
        zero = list(state.rglob("*zero_pp_rank_1_*optim_states.pt"))
        assert len(zero) == 1
        zero[0].unlink()
    with pytest.raises(StateError, match="zero_pp_rank_1_.*optim_states.pt, which its manifest lists, is missing"):
        find_resumable(out, plan, out / "ds_config.json", 2)
