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


def equal_pass_probability(n: int, discordance: float, margin_points: float, confidence: float) -> float:
    """The probability that a candidate equal to its control passes the paired screen (lower bound > margin) on
    n cases, when each case is discordant with probability `discordance` and a discordant case is a win or a loss
    with probability 1/2 each: the screen's power against the declared margin, before any case is drawn
    (pass_probability at no advantage)."""
    return pass_probability(n, discordance, margin_points, confidence)


def pass_probability(n: int, discordance: float, margin_points: float, confidence: float,
                     advantage_points: float = 0.0) -> float:
    """The probability that the paired screen passes (lower bound > margin) on n cases when the candidate's true
    advantage is `advantage_points`: each case is discordant with probability q = `discordance`, and a discordant
    case is a win with probability (q + d) / 2q (d the advantage as a fraction), so the expected difference is d.
    At d = 0 this is an equal candidate's pass rate; at d > 0 with margin 0, a superiority screen's power.

    With D discordant cases, W of them wins and L = D − W losses, the per-case differences are +1 (W times), −1
    (L times) and 0, so mean = (W − L)/n, s² = (D − n·mean²)/(n − 1) and the lower bound is mean − z·s/√n
    (mean_interval's). D ~ Binomial(n, q), W | D ~ Binomial(D, (q + d)/2q); the sum runs over every (D, W) whose
    probability is not negligible (each D below 1e-18 is left out)."""
    import numpy as np
    from scipy.stats import binom

    if n < 2:
        raise ValueError(f"n={n}: a paired bound needs at least 2 cases")
    if not 0.0 <= discordance <= 1.0:
        raise ValueError(f"discordance={discordance} must lie in [0, 1]")
    if not 0.0 <= advantage_points / 100 <= discordance:
        raise ValueError(f"advantage {advantage_points} points at discordance {discordance}: an advantage lies in "
                         f"[0, 100 x discordance] (every discordant case a win at most)")
    win = 0.5 + advantage_points / 100 / (2 * discordance) if discordance else 0.5
    z = two_sided_z(confidence)
    d = np.arange(n + 1)
    p_d = binom.pmf(d, n, discordance)
    keep = p_d > 1e-18
    total = 0.0
    for discordant, weight in zip(d[keep], p_d[keep]):
        wins = np.arange(discordant + 1)
        p_w = binom.pmf(wins, discordant, win)
        mean = (2 * wins - discordant) / n
        var = np.maximum(discordant - n * mean ** 2, 0.0) / (n - 1)
        lower = mean - z * np.sqrt(var) / math.sqrt(n)
        total += weight * float(p_w[100 * lower > margin_points].sum())
    return min(float(total), 1.0)  # a Python float: numpy's would make every comparison with it a numpy bool


def cases_for_power(discordance: float, margin_points: float, confidence: float, target: float = 0.90,
                    at_least: int = 2, advantage_points: float = 0.0) -> int:
    """The fewest cases, from `at_least` up (a screen's declared n), at which the screen passes with at least `target`
    probability for a candidate `advantage_points` ahead (0: equal to its control): doubling, then bisection. The
    probability rises with n once discordant cases are expected at all (at a handful of cases, none discordant, a
    zero-width interval passes), up to the small steps of a discrete count."""
    def reaches(n: int) -> bool:
        return pass_probability(n, discordance, margin_points, confidence, advantage_points) >= target

    low = max(at_least, 2)
    if discordance <= 0 or reaches(low):
        return low
    high = 2 * low
    while not reaches(high):
        low, high = high, high * 2
        if high > 1_000_000:
            raise ValueError(f"no case count up to 1,000,000 reaches {target:.0%} at discordance {discordance}")
    while high - low > 1:
        mid = (low + high) // 2
        if reaches(mid):
            high = mid
        else:
            low = mid
    return high


def declared_power(n: int, discordance: float | None, margin_points: float, confidence: float) -> dict:
    """What a paired screen's declaration says before scoring: the probability that an equal candidate passes at
    n cases, and, where it is under 80%, the number of cases that would reach 90%."""
    if not discordance:
        return {"n": n, "expected_discordance": None, "equal_pass_probability": None,
                "note": "no expected discordance declared (screens.expected_discordance): the screen's power is unknown"}
    p = float(equal_pass_probability(n, discordance, margin_points, confidence))
    out = {"n": n, "expected_discordance": discordance, "equal_pass_probability": p, "note": None}
    if p < 0.80:
        needed = cases_for_power(discordance, margin_points, confidence, 0.90, at_least=n)
        out["cases_for_90"] = needed
        out["note"] = (f"underpowered: a candidate equal to its control passes only {p:.0%} of the time at n={n}; "
                       f"about {needed} cases would reach 90%")
    return out


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
