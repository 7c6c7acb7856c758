"""Where each second of an update goes (nshard/phases.py): the clock's nesting arithmetic, PowerSGD's phases on two
real gloo ranks, the receipts' medians; and (slow tier, reading the suite's shared runs) every update's phases in
metrics.jsonl and the receipts of stage-0 and ZeRO-2 PowerSGD runs and a one-rank DeepSpeed run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nshard.phases import DETAIL, PHASES, REST, PhaseClock
from nshard.run.receipts import Receipt
from spawn import run_ranks

ALL = (*PHASES, REST)


class FakeTime:
    """perf_counter's stand-in: the test sets the time."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def clock_with_fake_time():
    now, syncs = FakeTime(), []
    return PhaseClock(sync=lambda: syncs.append(now.t), now=now), now, syncs


def test_a_phase_inside_another_is_taken_out_of_it_and_the_phases_sum_to_the_update():
    clock, now, syncs = clock_with_fake_time()
    clock.start()
    now.t = 1.0
    with clock.phase("forward_backward"):
        now.t = 3.0
        with clock.phase("reducer_compute"):
            now.t = 4.0
            with clock.phase("collective_wait"):
                now.t = 7.0
            now.t = 8.0
        now.t = 10.0
    split = clock.stop(12.0)
    assert split["phases"] == {"forward_backward": 4.0, "reducer_compute": 2.0, "collective_wait": 3.0,
                               "optimizer_step": 0.0, "parameter_sync": 0.0, REST: 3.0}
    assert list(split["phases"]) == list(ALL)
    assert math.fsum(split["phases"].values()) == 12.0
    assert syncs == [1.0, 3.0, 4.0, 7.0, 8.0, 10.0]  # the device waited for at every boundary, before the time is read


def test_a_phase_entered_inside_itself_is_one_frame():
    clock, now, syncs = clock_with_fake_time()
    clock.start()
    with clock.phase("collective_wait"):  # the transport's all-reduce ...
        now.t = 1.0
        with clock.phase("collective_wait"):  # ... calling deepspeed.comm's, counted and timed too
            now.t = 2.0
        now.t = 3.0
    assert clock.stop(3.0)["phases"]["collective_wait"] == 3.0 and len(syncs) == 2


def test_details_count_in_their_phase_and_a_collective_in_the_parameter_sync_is_a_parameter_collective():
    clock, now, _ = clock_with_fake_time()
    clock.start()
    with clock.phase("reducer_compute"):
        now.t = 1.0
        with clock.phase("powersgd_pq"):
            now.t = 3.0
            with clock.phase("collective_wait"):
                now.t = 4.0
        with clock.phase("orthogonalize"):
            now.t = 4.5
        with clock.phase("error_update"):
            now.t = 5.0
    with clock.phase("parameter_sync"):
        now.t = 6.0
        with clock.phase("collective_wait"):
            now.t = 9.0
    split = clock.stop(9.0)
    assert split["detail"] == {"powersgd_pq": 2.0, "orthogonalize": 0.5, "error_update": 0.5,
                               "parameter_collectives": 3.0}
    assert split["phases"] == {"forward_backward": 0.0, "reducer_compute": 4.0, "collective_wait": 4.0,
                               "optimizer_step": 0.0, "parameter_sync": 1.0, REST: 0.0}
    assert set(DETAIL.values()) <= set(PHASES)


class FakeEvent:
    """torch.cuda.Event's stand-in: record() reads the fake time, elapsed_time() is in milliseconds."""

    def __init__(self, now: FakeTime):
        self.now, self.t = now, None

    def record(self) -> None:
        self.t = self.now.t

    def elapsed_time(self, later: "FakeEvent") -> float:
        return (later.t - self.t) * 1000


def reducer_timeline(clock: PhaseClock, now: FakeTime) -> dict:
    """One update: a reducer phase whose detail alternates per matrix, with a collective inside one P product."""
    clock.start()
    with clock.phase("reducer_compute"):
        now.t = 1.0
        for _ in range(2):
            with clock.phase("powersgd_pq"):
                now.t += 1.0
                with clock.phase("powersgd_pq"):  # a detail inside itself: one
                    now.t += 0.5
            with clock.phase("error_update"):
                now.t += 0.25
        with clock.phase("powersgd_pq"):
            now.t += 1.0
            with clock.phase("collective_wait"):
                now.t += 4.0
            now.t += 1.0
        with clock.phase("orthogonalize"):
            now.t += 2.0
        now.t += 1.0
    return clock.stop(now.t + 1.0)


def nested_timelines():
    """Updates whose detail nests in every way the clock allows: (name, steps), each step ("in", name), ("out",) or
    ("tick", seconds)."""
    def frame(name, *inner):
        return [("in", name), *inner, ("out",)]

    tick = ("tick", 1.0)
    return {
        "a phase re-entered inside a detail": frame("reducer_compute", tick, frame(
            "powersgd_pq", tick, frame("reducer_compute", tick), tick), tick),
        "another detail inside a collective inside a detail": frame("reducer_compute", frame(
            "powersgd_pq", tick, frame("collective_wait", tick, frame("error_update", tick), tick), tick)),
        "the same detail inside a collective inside it": frame("reducer_compute", frame(
            "powersgd_pq", tick, frame("collective_wait", tick, frame("powersgd_pq", tick), tick), tick)),
        "a detail outside its phase": frame("forward_backward", tick, frame("powersgd_pq", tick), tick),
        "a detail with no phase open": frame("orthogonalize", tick),
        "a detail inside another": frame("reducer_compute", frame(
            "orthogonalize", tick, frame("powersgd_pq", tick, frame("powersgd_pq", tick)), tick), tick),
    }


def play(clock: PhaseClock, now: FakeTime, steps) -> dict:
    now.t = 0.0
    clock.start()
    frames = []

    def run(step):
        if isinstance(step, list):
            for s in step:
                run(s)
        elif step[0] == "in":
            frames.append(clock.phase(step[1]))
            frames[-1].__enter__()
        elif step[0] == "out":
            frames.pop().__exit__(None, None, None)
        else:
            now.t += step[1]

    run(steps)
    return clock.stop(now.t + 1.0)


@pytest.mark.parametrize("name", list(nested_timelines()))
def test_event_timed_detail_counts_every_nesting_as_the_host_does(name):
    steps = nested_timelines()[name]
    host, host_now, _ = clock_with_fake_time()
    events, now, _ = clock_with_fake_time()
    events.event = lambda: FakeEvent(now)
    by_host, by_events = play(host, host_now, steps), play(events, now, steps)
    assert by_events == by_host, name
    assert events._detail_stack == [] and events._stack == []
    for detail, parent in DETAIL.items():
        assert by_events["detail"][detail] <= by_events["phases"][parent], (name, detail)


def test_on_cuda_the_reducer_detail_is_timed_by_events_without_a_wait_and_gives_the_hosts_figures():
    host, host_now, _ = clock_with_fake_time()
    events, now, syncs = clock_with_fake_time()
    made = []
    events.event = lambda: made.append(FakeEvent(now)) or made[-1]
    by_host, by_events = reducer_timeline(host, host_now), reducer_timeline(events, now)
    assert by_events == by_host
    assert by_events["detail"] == {"powersgd_pq": 5.0, "orthogonalize": 2.0, "error_update": 0.5,
                                   "parameter_collectives": 0.0}
    assert by_events["phases"]["reducer_compute"] == 9.5 and by_events["phases"]["collective_wait"] == 4.0
    assert syncs == [0.0, 5.5, 9.5, 13.5]  # only the phases' boundaries waited; the detail's recorded events
    assert len(made) == 14  # one per detail boundary, plus one each side of the collective inside a detail
    now.t = 0.0
    assert reducer_timeline(events, now) == by_host and len(made) == 14  # the events are reused


def test_each_microbatch_keeps_its_own_forward_backward():
    clock, now, _ = clock_with_fake_time()
    clock.start()
    with clock.microbatch():
        now.t = 2.0
    with clock.microbatch():
        now.t = 3.0
        with clock.phase("optimizer_step"):
            now.t = 7.0
        now.t = 8.0
    split = clock.stop(9.0)
    assert split["microbatch_s"] == [2.0, 2.0] and split["phases"]["forward_backward"] == 4.0
    assert split["phases"]["optimizer_step"] == 4.0 and split["phases"][REST] == 1.0


def test_a_stopped_clock_costs_no_wait_and_records_nothing_and_a_misspelt_phase_is_refused():
    clock, now, syncs = clock_with_fake_time()
    with clock.phase("collective_wait"), clock.microbatch():
        now.t = 5.0
    assert syncs == [] and clock.totals == {} and clock.microbatch_s == []
    with pytest.raises(ValueError, match=r"phase 'collective': use one of forward_backward, .*parameter_sync"):
        clock.phase("collective")
    clock.use_device(torch.device("cpu"))
    assert clock.sync is None and clock.event is None
    clock.use_device(torch.device("cuda", 0))
    assert clock.sync is torch.cuda.synchronize and clock.event is not None  # set, not called


def test_nshard_phase_sync_0_takes_the_waits_and_events_away_on_cuda_and_another_value_is_refused(monkeypatch):
    from nshard.run.receipts import synchronized

    clock = PhaseClock()
    monkeypatch.setenv("NSHARD_PHASE_SYNC", "0")
    clock.use_device(torch.device("cuda", 0))
    assert clock.sync is None and clock.event is None and clock.on_cuda
    assert synchronized(clock).startswith("none (NSHARD_PHASE_SYNC=0)")
    clock.use_device(torch.device("cpu"))
    assert synchronized(clock) == "no device synchronization (the CPU)"
    monkeypatch.setenv("NSHARD_PHASE_SYNC", "yes")
    with pytest.raises(ValueError, match=r"NSHARD_PHASE_SYNC='yes': set it to 1 .* or 0"):
        clock.use_device(torch.device("cuda", 0))
    monkeypatch.delenv("NSHARD_PHASE_SYNC")
    clock.use_device(torch.device("cuda", 0))
    assert synchronized(clock).startswith("torch.cuda.synchronize() at every phase boundary; the reducer's detail")


def _powersgd_phases(rank: int, world: int) -> list[dict]:
    """One dense warm-up update and two PowerSGD updates of the reducer the trainer builds, on the process's clock."""
    import torch.distributed as dist

    from nshard.comm import build_reducer
    from nshard.phases import CLOCK

    reducer = build_reducer({"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1, "min_compression_rate": 1,
                             "seed": 0, "transport": "torch"}, all_reduce=dist.all_reduce)
    splits = []
    for update in range(3):
        gen = torch.Generator().manual_seed(10 * update + rank)
        grads = {"a.weight": torch.randn(32, 48, generator=gen), "b.weight": torch.randn(32, 48, generator=gen),
                 "bias": torch.randn(32, generator=gen)}
        CLOCK.start()
        t0 = CLOCK.now()
        reducer.reduce(grads)
        seconds = CLOCK.now() - t0
        splits.append({**CLOCK.stop(seconds), "update_s": seconds})
    return splits


def test_powersgd_updates_split_into_reducer_compute_and_collectives_on_two_ranks():
    for splits in run_ranks(_powersgd_phases, world_size=2):
        for split in splits:
            assert math.isclose(math.fsum(split["phases"].values()), split["update_s"], rel_tol=1e-12)
            assert split["phases"]["collective_wait"] > 0 and split["phases"]["reducer_compute"] > 0, split
            assert split["phases"][REST] >= 0 and split["phases"]["forward_backward"] == 0
        warmup, *compressed = splits
        assert {warmup["detail"][d] for d in ("powersgd_pq", "orthogonalize", "error_update")} == {0.0}
        for split in compressed:
            assert all(split["detail"][d] > 0 for d in ("powersgd_pq", "orthogonalize", "error_update")), split
            assert math.fsum(split["detail"][d] for d in ("powersgd_pq", "orthogonalize", "error_update")) \
                <= split["phases"]["reducer_compute"]


def _split(fb: float, rc: float, cw: float, rest: float, pq: float = 0.0) -> dict:
    phases = {"forward_backward": fb, "reducer_compute": rc, "collective_wait": cw, "optimizer_step": 0.0,
              "parameter_sync": 0.0, REST: rest}
    return {"phases": phases, "detail": {**{d: 0.0 for d in DETAIL}, "powersgd_pq": pq}, "microbatch_s": [fb]}


def test_the_receipt_keeps_every_split_and_the_medians_of_dense_and_compressed_updates_apart():
    receipt = Receipt(0, 2)
    updates = [(1.0, False, _split(0.5, 0.1, 0.4, 0.0)), (1.0, True, _split(0.2, 0.7, 0.1, 0.0, pq=0.3)),
               (2.0, True, _split(0.4, 0.9, 0.5, 0.2, pq=0.5)), (3.0, True, _split(0.6, 2.0, 0.3, 0.1, pq=0.4))]
    for seconds, compressed, split in updates:
        receipt.record_update(seconds, 10, 0, compressed, timing=split)
    phases = receipt.by_phase()
    assert phases["dense"]["updates"] == 1 and phases["dense"]["largest_phase"] == "forward_backward"
    assert phases["compressed"]["median_phase_s"]["reducer_compute"] == 0.9
    assert phases["compressed"]["median_phase_detail_s"]["powersgd_pq"] == 0.4
    assert phases["compressed"]["largest_phase"] == "reducer_compute"
    assert phases["compressed"]["median_update_s"] == 2.0  # the keys other code reads are kept
    assert Receipt.from_state_dict(receipt.state_dict()).update_phases == receipt.update_phases
    assert receipt.update_microbatch_s == [[0.5], [0.2], [0.4], [0.6]]


def test_a_state_saved_before_phases_were_recorded_leaves_its_updates_out_of_the_medians():
    old = Receipt(0, 2)
    old.record_update(9.0, 10, 0, True)  # no timing: an update of a state from before the phases
    state = {k: v for k, v in old.state_dict().items() if k not in ("update_phases", "update_phase_detail",
                                                                      "update_microbatch_s")}
    receipt = Receipt.from_state_dict(state)
    receipt.record_update(1.0, 10, 0, True, timing=_split(0.2, 0.7, 0.1, 0.0))
    compressed = receipt.by_phase()["compressed"]
    assert compressed["updates"] == 2 and compressed["median_phase_s"]["reducer_compute"] == 0.7
    assert Receipt(0, 1).by_phase()["dense"]["median_phase_s"] is None


# ---------------------------------------------------------------- launched runs (the suite's shared ones)


def _runs(runs_root) -> dict:
    from runs import cached_run, tiny_config
    from test_reducer_engine import psgd

    # The names and configurations of tests/test_reducer_engine.py's and tests/test_arms.py's runs: in one session
    # each is launched once, for whichever test comes first.
    return {"psgd-z0": cached_run(runs_root, "psgd-z0", tiny_config(stage=0, nshard=psgd())),
            "psgd-z2": cached_run(runs_root, "psgd-z2", tiny_config(stage=2, nshard=psgd())),
            "ds-one": cached_run(runs_root, "ds-one", tiny_config(), world=1)}


@pytest.fixture(scope="module")
def phase_runs(runs_root):
    return _runs(runs_root)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_update_s_phases_sum_to_its_update_s_in_metrics_and_receipts(phase_runs):
    from nshard.run.data import accumulation_steps
    from nshard.run.plan import load_plan
    from runs import REPO, receipts

    train = load_plan(REPO / "launch/plans/tiny.toml").train
    for name, out in phase_runs.items():
        lines, rs = _metrics(out), receipts(out)
        schedule = json.loads((out / "prepared/schedule.json").read_text())
        assert [line["phases"] for line in lines] == rs[0]["update_phases"], name  # rank 0's, the same floats
        assert [line["microbatch_s"] for line in lines] == rs[0]["update_microbatch_s"], name
        for r in rs:
            assert r["phases"]["order"] == list(ALL) and r["phases"]["synchronized"].startswith("no device")
            assert len(r["update_phases"]) == len(r["update_s"]) == len(r["update_microbatch_s"]) == 3, name
            for update_s, phases, detail, micro, batch in zip(r["update_s"], r["update_phases"],
                                                              r["update_phase_detail"], r["update_microbatch_s"],
                                                              schedule):
                assert set(phases) == set(ALL), name  # the receipt JSON sorts its keys
                assert abs(math.fsum(phases.values()) - update_s) <= 0.02 * update_s, (name, phases, update_s)
                assert all(v >= 0 for v in phases.values()), (name, phases)
                assert phases["forward_backward"] > 0 and phases["optimizer_step"] > 0, (name, phases)
                assert len(micro) == accumulation_steps(len(batch), r["world_size"], train.microbatch_docs), name
                assert math.isclose(math.fsum(micro), phases["forward_backward"], rel_tol=1e-9), name
                for d, parent in DETAIL.items():
                    assert 0 <= detail[d] <= phases[parent], (name, d, detail, phases)


@pytest.mark.slow
def test_powersgd_updates_spend_time_in_the_reducer_and_collectives_and_one_dense_rank_waits_on_none(phase_runs):
    from runs import receipts

    for name in ("psgd-z0", "psgd-z2"):
        for r in receipts(phase_runs[name]):
            assert r["update_compressed"] == [False, True, True], name
            for compressed, phases, detail in zip(r["update_compressed"], r["update_phases"], r["update_phase_detail"]):
                assert phases["reducer_compute"] > 0 and phases["collective_wait"] > 0, (name, phases)
                powersgd = [detail[d] for d in ("powersgd_pq", "orthogonalize", "error_update")]
                assert all(s > 0 for s in powersgd) if compressed else powersgd == [0, 0, 0], (name, detail)
            # ZeRO-2 ends every step with the ring all-gather of the weights: parameter_sync, its ring collectives.
            sync = [p["parameter_sync"] for p in r["update_phases"]]
            gathered = [d["parameter_collectives"] for d in r["update_phase_detail"]]
            assert (all(s > 0 for s in sync + gathered) if name == "psgd-z2" else sync + gathered == [0] * 6), name
            compressed = r["by_phase"]["compressed"]
            assert compressed["updates"] == 2 and set(compressed["median_phase_s"]) == set(ALL)
            assert compressed["largest_phase"] in ALL
    for r in receipts(phase_runs["ds-one"]):
        # One rank: DeepSpeed's reduction epilogue is replaced by the zero gradients it gives unused parameters (no
        # bucket, no all-reduce: gradient-path.md#one-rank), still timed as the reducer's compute.
        assert r["reduction_ran"]["one_rank"] == "skipped"
        for update_s, phases in zip(r["update_s"], r["update_phases"]):
            # Bounded against the same update's forward and backward, not in seconds (a loaded machine's scheduler
            # stretches milliseconds); a backward counted as waiting or as the reducer's (the attribution this
            # guards) would put either above a quarter of it.
            assert phases["collective_wait"] <= 0.25 * phases["forward_backward"], phases
            assert 0 <= phases["reducer_compute"] <= 0.25 * phases["forward_backward"], phases
            assert phases["parameter_sync"] == 0, phases


def test_the_report_lists_the_phases_in_the_clocks_order():
    from nshard.analysis.report import PHASE_ORDER
    from nshard.phases import PHASES, REST

    assert PHASE_ORDER == (*PHASES, REST)
