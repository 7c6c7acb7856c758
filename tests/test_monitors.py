"""DeepSpeed's monitors under nshard (nshard/seam/observe.py): csv_monitor, tensorboard and wandb (offline) carry the
same values as metrics.jsonl, on the documents-trained step; metrics.jsonl and the receipts carry throughput, MFU
and the gradient norm (nshard/run/throughput.py). Real runs of the tiny plan through the deepspeed launcher."""

from __future__ import annotations

import csv
import itertools
import json
import math
import struct
from pathlib import Path

import pytest

from nshard.run import budget
from nshard.seam.observe import PREFIX, TAGS
from runs import cached_run, launch, receipts, tiny_config

pytestmark = pytest.mark.slow  # every test here reads launched runs

POWERSGD = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1}
THROUGHPUT_KEYS = ("tokens", "response_tokens", "tokens_per_s", "response_tokens_per_s", "flops", "achieved_tflops",
                   "peak_tflops", "mfu", "grad_norm")


def _with_monitor(config: dict, kind: str, root: Path) -> dict:
    return {**config, kind: {"enabled": True, "output_path": str(root / f"{kind}-out"), "job_name": "job"}}


@pytest.fixture(scope="module")
def csv_run(runs_root):
    """Stage 0, fp32, PowerSGD after one dense update, two ranks, csv_monitor on."""
    return cached_run(runs_root, "monitor-csv", _with_monitor(tiny_config(nshard=POWERSGD), "csv_monitor", runs_root))


@pytest.fixture(scope="module")
def tb_run(runs_root):
    """The same reducer at ZeRO-2 (the ingest seam, DeepSpeed's own norm), tensorboard on."""
    config = _with_monitor(tiny_config(stage=2, nshard=POWERSGD), "tensorboard", runs_root)
    return cached_run(runs_root, "monitor-tensorboard", config)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def samples(out: Path) -> list[int]:
    """The monitors' step of each update: documents trained through it."""
    return list(itertools.accumulate(len(b) for b in json.loads((out / "prepared/schedule.json").read_text())))


def expected(out: Path, key: str) -> list[tuple[int, float]]:
    return [(step, line[key]) for step, line in zip(samples(out), metrics(out)) if line.get(key) is not None]


def test_csv_monitor_holds_exactly_the_metrics_values(csv_run, runs_root):
    folder = runs_root / "csv_monitor-out" / "job"
    lines = metrics(csv_run)
    assert [line["compressed"] for line in lines] == [False, True, True]
    for key, tag in TAGS.items():
        path = folder / f"{(PREFIX + tag).replace('/', '_')}.csv"
        want = expected(csv_run, key)
        if not want:
            assert not path.exists(), f"{path.name} written though metrics.jsonl has no {key}"
            continue
        rows = list(csv.reader(path.open()))
        assert rows[0] == ["step", tag]
        # Python writes a float's shortest round-trip repr in both files: equal floats, not approximately equal.
        assert [(int(s), float(v)) for s, v in rows[1:]] == want, key
    # DeepSpeed's own lr (the next update's rate) was dropped: one row per update, nshard's.
    assert len(list(csv.reader((folder / "Train_Samples_lr.csv").open()))) == 1 + len(lines)
    assert [s for s, _ in expected(csv_run, "compression_error_norm")] == samples(csv_run)[1:]


def test_tensorboard_holds_the_metrics_values_at_float32(tb_run, runs_root):
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs_root / "tensorboard-out" / "job"), size_guidance={"scalars": 0})
    events.Reload()
    written = set(events.Tags()["scalars"])
    for key, tag in TAGS.items():
        want = expected(tb_run, key)
        assert (PREFIX + tag in written) == bool(want), key
        if want:
            got = [(e.step, e.value) for e in events.Scalars(PREFIX + tag)]
            # A tensorboard scalar is a 32-bit float: the metrics value rounded once to float32, exactly.
            assert got == [(step, float(np.float32(value))) for step, value in want], key


def test_every_update_and_receipt_has_throughput_mfu_and_the_grad_norm(csv_run):
    lines, rs = metrics(csv_run), receipts(csv_run)
    how = rs[0]["throughput"]
    assert how["flops_count"] == budget.HOW and how["peak"]["source"] and how["peak"]["tflops_per_device"] > 0
    assert how["devices"] == 2 and how["peak_tflops"] == 2 * how["peak"]["tflops_per_device"]
    for line, per_rank in zip(lines, zip(*(r["update_throughput"] for r in rs))):
        assert all(line[k] is not None for k in THROUGHPUT_KEYS), line
        assert line["flops"] == budget.flops(how["active_parameters_per_token"], [line["tokens"]])
        assert line["tokens_per_s"] == line["tokens"] / line["update_s"]
        assert line["mfu"] == line["achieved_tflops"] / line["peak_tflops"] and line["peak_tflops"] == how["peak_tflops"]
        assert {k: line[k] for k in per_rank[0]} == per_rank[0]  # rank 0's receipt: metrics.jsonl's values
        assert per_rank[0]["grad_norm"] == per_rank[1]["grad_norm"]  # the reduced gradient: one norm on all ranks
        assert per_rank[0]["tokens"] == per_rank[1]["tokens"]
    run = how["run"]
    assert run["tokens"] == sum(line["tokens"] for line in lines)
    assert math.isclose(run["update_s"], sum(line["update_s"] for line in lines))


def test_the_grad_norm_is_the_same_before_clipping_at_stage_0_and_zero_2(csv_run, tb_run):
    """The norm stage 0's clip computes (fp32, kept from DeepSpeed's clip_grad_norm_) and DeepSpeed's (ZeRO-2, from the
    reduced partitions) measure the same gradient: the same reducer reduces it, and fp32 stages 0 and 2 train the
    same weights."""
    stage0, zero2 = metrics(csv_run), metrics(tb_run)
    assert receipts(csv_run)[0]["throughput"]["grad_norm"].startswith("deepspeed: clip_grad_norm_")
    assert receipts(tb_run)[0]["throughput"]["grad_norm"].startswith("deepspeed")
    for a, b in zip(stage0, zero2):
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["grad_norm"], b["grad_norm"])
    clipping = json.loads((csv_run / "ds_config.json").read_text())["gradient_clipping"]
    assert stage0[0]["grad_norm"] > clipping  # a clipped norm could not exceed the clipping threshold


def wandb_history(path: Path) -> list[dict]:
    """The history rows of a .wandb file: LevelDB-log framing (32 KiB blocks, 7-byte record headers: crc32,
    length, type 1 full / 2 first / 3 middle / 4 last) around wandb's Record protobufs, after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data, pos, part, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_holds_exactly_the_metrics_values(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[monitors])")
    out, wandb_dir, scratch = tmp_path / "run", tmp_path / "wandb-dir", tmp_path / "tmp"
    wandb_dir.mkdir()
    scratch.mkdir()  # wandb makes its media and artifact folders in the temporary directory and leaves them there
    config = {**tiny_config(), "wandb": {"enabled": True, "project": "nshard-test"}}
    launch(out, config, world=1, env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
                                      "TMPDIR": str(scratch)})
    [path] = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    history = wandb_history(path)
    assert [row["_step"] for row in history] == samples(out)
    for key, tag in TAGS.items():
        got = [(row["_step"], row[PREFIX + tag]) for row in history if PREFIX + tag in row]
        assert got == expected(out, key), key
