"""Paired accuracy bounds: the difference of two models scored on the same cases, with a normal-approximation
interval on the per-case differences (sample standard deviation, quantile from scipy).

    python -m nshard.analysis.paired CANDIDATE.jsonl CONTROL.jsonl [--confidence 0.99]

Each file is JSONL with at least `case_id` and `correct`; the files must hold the same case IDs.
Prints one JSON object: n, discordant, difference_points, lower_points, upper_points.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from scipy.stats import norm

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog


class PairingError(ValueError):
    """Two per-case files that cannot be paired; the message names the case or the file."""


def two_sided_z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must lie in (0, 1)")
    return float(norm.ppf(1.0 - (1.0 - confidence) / 2.0))


def mean_interval(values: list[float], confidence: float) -> tuple[float, float, float]:
    """(mean, lower, upper): mean ± z · s/√n, with s the sample standard deviation (n − 1)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = two_sided_z(confidence) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def cases_for_one_loss(margin_points: float, confidence: float) -> int:
    """The fewest cases at which a candidate that loses exactly one case (and wins none) still has a paired
    lower bound above `margin_points` (< 0). With d = -1 once and 0 n-1 times, mean = -1/n and s = 1/sqrt(n),
    so the lower bound is -(1 + z)/n, in points -100(1 + z)/n."""
    if not margin_points < 0:
        raise ValueError(f"margin {margin_points} points: a noninferiority margin is negative")
    return math.floor(100 * (1 + two_sided_z(confidence)) / -margin_points) + 1


def paired_bounds(candidate: dict[str, bool], control: dict[str, bool], confidence: float = 0.99) -> dict:
    """Candidate minus control over the same cases, in accuracy points (100 × the mean difference)."""
    if set(candidate) != set(control):
        only = sorted(set(candidate) ^ set(control))
        raise PairingError(f"the files hold different case IDs (e.g. {only[0]}); pair models scored on the same cases")
    ids = sorted(candidate)
    diffs = [float(bool(candidate[i])) - float(bool(control[i])) for i in ids]
    mean, lower, upper = mean_interval(diffs, confidence)
    discordant = sum(1 for d in diffs if d != 0)
    # No discordant pair: every difference is 0, so is the sample deviation, and the interval has zero
    # width; it says the arms agreed on these cases, not how far apart they could be.
    return {"n": len(ids), "discordant": discordant, "zero_width": discordant == 0, "confidence": confidence,
            "candidate_correct": sum(bool(candidate[i]) for i in ids),
            "control_correct": sum(bool(control[i]) for i in ids),
            "difference_points": 100 * mean, "lower_points": 100 * lower, "upper_points": 100 * upper}


def read_correct(path: Path) -> dict[str, bool]:
    """case_id -> correct from a per-case JSONL file; a repeated or malformed line is an error naming it."""
    out: dict[str, bool] = {}
    with Path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                cid, correct = row["case_id"], row["correct"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise PairingError(f"{path}:{lineno}: each line needs a JSON object with case_id and correct") from None
            if not isinstance(correct, bool):
                raise PairingError(f"{path}:{lineno}: correct must be true or false, got {correct!r}")
            if cid in out:
                raise PairingError(f"{path}:{lineno}: case {cid} appears twice")
            out[cid] = correct
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.analysis.paired"), description=__doc__,
                            epilog="Writes nothing: prints one JSON line. " + SPELLING_NOTE)
    parser.add_argument("candidate", type=Path)
    parser.add_argument("control", type=Path)
    parser.add_argument("--confidence", type=float, default=0.99)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = paired_bounds(read_correct(args.candidate), read_correct(args.control), args.confidence)
    except (PairingError, ValueError, OSError) as exc:
        print(f"nshard.analysis.paired: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: result[k] for k in ("n", "discordant", "difference_points", "lower_points",
                                             "upper_points")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
