"""The ZeRO stage comparison table: one row per arm (ZeRO stage x reducer) from the run directories
under one directory, written as zero_table.md and zero_table.json. Reads files only (no torch).

    python -m nshard.analysis.zero_table runs/zero-stages
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.files import write_text_atomic

RUN_KEYS = ("status", "plan", "plan_sha256", "world_size", "zero_stage", "reducer")
RECEIPT_KEYS = ("rank", "update_s", "update_grad_bytes", "update_compressed", "parameter_root", "peak_rss_bytes")
# Per-rank values; the last three are absent from older receipts (and GPU peak from CPU runs).
PER_RANK_KEYS = ("peak_rss_bytes", "peak_allocated_bytes", "optimizer_state_bytes", "master_param_bytes")
# numpy has no bfloat16: its bits are the upper half of a float32's, widened by hand in load_weights.
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


class TableError(ValueError):
    """A comparison directory the table cannot be built from; the message names the file."""


def read_json(path: Path, keys: tuple = ()) -> dict:
    if not path.is_file():
        raise TableError(f"{path} is missing")
    try:
        body = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TableError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    missing = [k for k in keys if not isinstance(body, dict) or k not in body]
    if missing:
        raise TableError(f"{path} lacks {missing}; the run did not finish writing it (rerun the arm)")
    return body


def read_receipts(arm_dir: Path, world_size: int) -> list[dict]:
    receipts = []
    for rank in range(world_size):
        path = arm_dir / "receipts" / f"rank-{rank}.json"
        body = read_json(path, RECEIPT_KEYS)
        lengths = {len(body[k]) for k in ("update_s", "update_grad_bytes", "update_compressed")}
        if len(lengths) != 1:
            raise TableError(f"{path}: update_s, update_grad_bytes and update_compressed differ in length")
        receipts.append(body)
    return receipts


def final_loss(arm_dir: Path) -> float:
    path = arm_dir / "metrics.jsonl"
    if not path.is_file():
        raise TableError(f"{path} is missing")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return float(json.loads(lines[-1])["loss"])
    except (IndexError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TableError(f"{path}: the last line is not a metrics record with a loss ({exc!r})") from None


def median(values: list) -> float | None:
    return statistics.median(values) if values else None


def arm_row(arm_dir: Path) -> dict:
    """One arm's row; payload and seconds are medians over every rank's updates of that kind."""
    run = read_json(arm_dir / "run.json", RUN_KEYS)
    if run["status"] != "complete":
        raise TableError(f"{arm_dir / 'run.json'}: status {run['status']!r}, not 'complete'; rerun the arm")
    receipts = read_receipts(arm_dir, run["world_size"])
    updates = [u for r in receipts for u in zip(r["update_grad_bytes"], r["update_s"], r["update_compressed"])]
    roots = [r["parameter_root"] for r in receipts]
    return {
        "arm": arm_dir.name, "stage": run["zero_stage"], "reducer": run["reducer"], "plan": run["plan"],
        "plan_sha256": run["plan_sha256"], "world_size": run["world_size"],
        "updates": len(receipts[0]["update_s"]), "compressed_updates": sum(receipts[0]["update_compressed"]),
        **{k: ([r.get(k) for r in receipts] if any(k in r for r in receipts) else None) for k in PER_RANK_KEYS},
        "payload_bytes_compressed_median": median([b for b, _, c in updates if c]),
        "payload_bytes_dense_median": median([b for b, _, c in updates if not c]),
        # Receipts from before the count existed lack it (None: "n/a").
        "parameter_bytes_median": median([b for r in receipts for b in r.get("update_parameter_bytes", [])]),
        "update_s_median": median([s for _, s, _ in updates]),
        "update_s_compressed_median": median([s for _, s, c in updates if c]),
        "final_loss": final_loss(arm_dir),
        "parameter_roots": roots, "ranks_agree": len(set(roots)) == 1, **arm_settings(arm_dir),
    }


def arm_settings(arm_dir: Path) -> dict:
    """The learning rate and nshard section from the arm's copy of its ds_config (absent: None)."""
    path = arm_dir / "ds_config.json"
    config = read_json(path) if path.is_file() else {}
    return {"lr": config.get("optimizer", {}).get("params", {}).get("lr"), "nshard": config.get("nshard")}


def load_weights(model_dir: Path) -> dict:
    """Every tensor in model_dir/*.safetensors as a numpy array (float; BF16 widened to float32)."""
    import numpy as np

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TableError(f"{model_dir} holds no .safetensors file; the run did not export its model")
    weights = {}
    for path in files:
        raw = path.read_bytes()
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + size])
        header.pop("__metadata__", None)
        for name, info in header.items():
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise TableError(f"{path}: tensor {name} is {info['dtype']}; the table compares float weights only")
            start, end = info["data_offsets"]
            a = np.frombuffer(raw[8 + size + start:8 + size + end], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            weights[name] = ((a.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else a
                             ).reshape(info["shape"])
    return weights


def max_abs_difference(a_dir: Path, b_dir: Path) -> float:
    import numpy as np

    a, b = load_weights(a_dir / "model"), load_weights(b_dir / "model")
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise TableError(f"{a_dir / 'model'} and {b_dir / 'model'} hold different tensors; not the same model")
    return max((float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a if a[k].size), default=0.0)


def compare_to_stage0(rows: list[dict], directory: Path) -> None:
    """Each arm against the stage-0 arm of the same reducer: root equality and the largest weight difference."""
    refs = {r["reducer"]: r for r in rows if r["stage"] == 0}
    for row in rows:
        ref = refs.get(row["reducer"])
        row["root_equals_stage0"] = row["max_abs_diff_vs_stage0"] = None
        if ref is None or ref is row:
            continue
        if row["ranks_agree"] and ref["ranks_agree"]:
            row["root_equals_stage0"] = row["parameter_roots"][0] == ref["parameter_roots"][0]
        row["max_abs_diff_vs_stage0"] = max_abs_difference(directory / row["arm"], directory / ref["arm"])


def build_table(directory: Path) -> dict:
    arm_dirs = sorted(p.parent for p in directory.glob("*/run.json"))
    if not arm_dirs:
        raise TableError(f"{directory} holds no run directories (subdirectories with run.json); "
                         f"run launch/zero_stages.py --out {directory}")
    rows = sorted((arm_row(d) for d in arm_dirs), key=lambda r: (r["reducer"], r["stage"], r["arm"]))
    shapes = {(r["plan_sha256"], r["world_size"]) for r in rows}
    if len(shapes) != 1:
        runs = {r["arm"]: f"plan {r['plan_sha256'][:12]}, {r['world_size']} ranks" for r in rows}
        raise TableError(f"{directory}: the arms ran different plans or world sizes, so they do not compare: {runs}")
    compare_to_stage0(rows, directory)
    return {"directory": str(directory), "plan": rows[0]["plan"], "plan_sha256": rows[0]["plan_sha256"],
            "world_size": rows[0]["world_size"], "arms": rows}


# ---------------------------------------------------------------- markdown


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_ranks(values) -> str:
    return "n/a" if values is None else " / ".join(fmt_bytes(v) for v in values)


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def fmt_root(row: dict) -> str:
    if row["ranks_agree"]:
        return f"`{row['parameter_roots'][0][:12]}`"
    return "**RANKS DISAGREE** " + " / ".join(f"`{r[:12]}`" for r in row["parameter_roots"])


def md_row(row: dict, gpu: bool) -> list[str]:
    ref = row["stage"] == 0
    equal = "ref" if ref else {None: "n/a", True: "yes", False: "no"}[row["root_equals_stage0"]]
    return [row["arm"], str(row["stage"]), row["reducer"], f"{row['compressed_updates']}/{row['updates']}",
            fmt_ranks(row["peak_rss_bytes"]), *([fmt_ranks(row["peak_allocated_bytes"])] if gpu else []),
            fmt_ranks(row["optimizer_state_bytes"]), fmt_ranks(row["master_param_bytes"]),
            fmt_bytes(row["payload_bytes_compressed_median"]), fmt_bytes(row["payload_bytes_dense_median"]),
            fmt_bytes(row.get("parameter_bytes_median")),
            fmt(row["update_s_median"], ".3f"), fmt(row["update_s_compressed_median"], ".3f"),
            fmt(row["final_loss"], ".4f"), fmt_root(row), equal,
            "ref" if ref else fmt(row["max_abs_diff_vs_stage0"], ".2e")]


def settings_line(rows: list[dict]) -> str:
    lrs = sorted({r["lr"] for r in rows if r["lr"] is not None})
    sections = {json.dumps(r["nshard"], sort_keys=True): r["nshard"] for r in rows if r["nshard"]}
    parts = [f"lr {' / '.join(f'{lr:g}' for lr in lrs) or 'n/a'}"]
    parts += [f"nshard {s['reducer']}" + (f" rank {s.get('rank')}, {s.get('dense_warmup_updates')} dense warm-up "
              "update(s)" if s["reducer"] == "powersgd" else "") for s in sections.values()]
    return "Settings: " + "; ".join(parts) + "."


def render_markdown(table: dict) -> str:
    gpu = any(r["peak_allocated_bytes"] for r in table["arms"])
    head = ["arm", "stage", "reducer", "compressed", "peak RSS / rank", *(["GPU peak alloc / rank"] if gpu else []),
            "optimizer state / rank", "master params / rank", "payload / compressed update",
            "payload / dense update", "parameter payload / update", "update s", "update s (compressed)",
            "final loss", "parameter root", "root = stage 0", "max abs diff vs stage 0"]
    lines = [f"# ZeRO stages: plan `{table['plan']}` (`{table['plan_sha256'][:12]}`), {table['world_size']} ranks",
             "", settings_line(table["arms"]), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(md_row(r, gpu)) + " |" for r in table["arms"]]
    lines += ["", "Per-rank columns list rank 0 first. Payload: gradient bytes one rank hands to "
              "collectives in an update (DeepSpeed's comms logger plus the nshard ledger); payload and update "
              "seconds are medians over every rank's updates of that kind. Parameter payload: the other "
              "collectives' bytes in an update, at ZeRO-1/2 the all-gather of the updated parameters, which "
              "PowerSGD does not compress. Differences against the same "
              "reducer's stage-0 arm come from fp32 sums taken in another order: expect small, not zero."]
    lines += [f"\n**WARNING**: the ranks of {r['arm']} disagree on the parameter root; do not use that arm."
              for r in table["arms"] if not r["ranks_agree"]]
    return "\n".join(lines) + "\n"


def write_table(directory: str | Path) -> dict:
    """Build the table from `directory` and write zero_table.json and zero_table.md into it."""
    directory = Path(directory)
    table = build_table(directory)
    write_text_atomic(directory / "zero_table.json", json.dumps(table, indent=1) + "\n")
    write_text_atomic(directory / "zero_table.md", render_markdown(table))
    return table


def build_parser() -> argparse.ArgumentParser:
    epilog = "Writes DIRECTORY/zero_table.md and zero_table.json; prints the table. " + SPELLING_NOTE
    parser = ArgumentParser(prog=prog("nshard.analysis.zero_table"), description=__doc__, epilog=epilog)
    parser.add_argument("directory", help="the comparison directory (one run directory per arm)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        write_table(args.directory)
    except (TableError, OSError, KeyError, TypeError, ValueError) as exc:
        print(f"zero_table: error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print((Path(args.directory) / "zero_table.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
