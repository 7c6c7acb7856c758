"""A growth study's table and screen (docs/growth.md#the-growth-study): the grown candidate against continued dense
training under one budget, what each arm cost to train and costs to serve, and the screen declared before any case
is drawn: the smallest advantage worth having with the cases that give it the declared power, a first-cohort
non-inferiority sub-screen against continued dense, family-stratified estimates where families are pooled. Reads
what nshard.analysis.report has gathered and the study's serving.json only; nshard.analysis.report's growth_screen
applies the conditions."""

from __future__ import annotations

import json
import math
from pathlib import Path

from nshard.analysis.paired import (PairingError, cases_for_one_loss, cases_for_power, paired_bounds, pass_probability,
                                    two_sided_z)


def read_serving(study_dir: Path) -> dict | None:
    path = Path(study_dir) / "serving.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _cell(value, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def growth_table(results: dict) -> str:
    """Budget and serving, one column per arm: what each arm cost to train and costs to serve."""
    growth, serving = results["growth"], results.get("serving") or {}
    names = [a["name"] for a in results["arms"]]
    budget = growth["budget"]
    rows = [
        ("Model", lambda n, g, s: "grown (sparse)" if g["grown"] else "continued dense"),
        ("Parameters", lambda n, g, s: _cell(s.get("parameters"), "{:,}")),
        ("Parameters per token (active)", lambda n, g, s: f"{g['active_parameters_per_token']:,}"),
        ("Of them frozen (no weight gradient)", lambda n, g, s: f"{g.get('frozen_active_parameters_per_token', 0):,}"),
        ("Training FLOPs per token", lambda n, g, s: f"{g.get('flops_per_token') or 6 * g['active_parameters_per_token']:,}"),
        ("Updates within the budget", lambda n, g, s: str(g["updates"])),
        ("Tokens trained", lambda n, g, s: f"{g['tokens']:,}"),
        ("Training FLOPs, share of the budget",
         lambda n, g, s: f"{g['train_flops']:.4g} ({g['train_flops'] / budget['train_flops']:.1%})"),
        ("Greedy tokens/s, batch 1", lambda n, g, s: _cell(s.get("tokens_per_s_batch_1"), "{:.2f}")),
        ("Greedy tokens/s, evaluation batch",
         lambda n, g, s: _cell(s.get("tokens_per_s_batch"), "{:.2f}") + (f" (batch {s['batch']})" if s else "")),
        ("Time to first token, batch 1", lambda n, g, s: _cell(s.get("time_to_first_token_s"), "{:.3f} s")),
        ("Peak memory serving", lambda n, g, s: _cell(s.get("peak_memory_bytes") and s["peak_memory_bytes"] / 2**30,
                                                      "{:.2f} GiB") + (f" ({s['peak_memory_kind']})" if s else "")),
        ("Export size", lambda n, g, s: _cell(s.get("export_bytes") and s["export_bytes"] / 1e6, "{:,.1f} MB")),
    ]
    lines = ["| Growth budget and serving | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for title, cell in rows:
        lines.append(f"| {title} | " + " | ".join(cell(n, growth["arms"][n], serving.get(n) or {}) for n in names)
                     + " |")
    lines += ["", f"Budget: {budget['train_flops']:.4g} training FLOPs ({budget['declared_as']}), counted as "
                  f"{budget['how']}."]
    if serving:
        any_s = next(iter(serving.values()))
        lines.append(f"Serving: measured one model per process after scoring on {any_s['device']} in {any_s['dtype']} "
                     f"({any_s['threads']} threads), {any_s['new_tokens']} forced new tokens, medians over "
                     f"{any_s['prompts']} prompts at batch 1 and {any_s['repeats']} batches.")
    return "\n".join(lines)


# ---------------------------------------------------------------- the screen, declared before drawing


def effective_cases(counts: dict[str, int], weights: dict[str, float] | None) -> float:
    """The cases a family-stratified estimate is worth: 1 / sum_f w_f^2 / n_f (the pooled count when the weights are
    the families' shares of the cases, fewer otherwise). No weights: the pooled count."""
    if not weights:
        return float(sum(counts.values()))
    return 1.0 / math.fsum(weights[f] ** 2 / counts[f] for f in weights)


def check_weights(counts: dict[str, int], weights: dict[str, float]) -> None:
    """Declared weights name exactly the families the fresh cases pool (ValueError naming the difference)."""
    if weights and set(weights) != set(counts):
        raise ValueError(f"growth.family_weights names {sorted(weights)} but the fresh cases pool {sorted(counts)}; "
                         "declare a weight for each of those families")


def screen_declaration(growth: dict, counts: dict[str, int], first_counts: dict[str, int], confidence: float,
                       margin_points: float) -> dict:
    """The growth screen as declared before drawing (plan [growth], counts: fresh cases per family; first_counts:
    the first cohort's): the advantage screen's power against growth.min_advantage_points at the fresh cases'
    effective number (margin: screens.min_growth_paired_lower_points) and the cases that would give growth.power;
    the first-cohort sub-screen's power for an equal candidate against growth.first_cohort_margin_points and the
    cases that would give growth.first_cohort_power. `sufficient` says whether both reach their power."""
    weights = growth.get("family_weights") or {}
    check_weights(counts, weights)
    out = {"confidence": confidence, "family_weights": weights or None, "advantage": None, "first_cohort": None}
    if growth.get("min_advantage_points"):
        n_eff = effective_cases(counts, weights)
        q, delta, target = growth["expected_discordance"], growth["min_advantage_points"], growth["power"]
        power = pass_probability(max(2, math.floor(n_eff)), q, margin_points, confidence, delta)
        needed = cases_for_power(q, margin_points, confidence, target, advantage_points=delta)
        out["advantage"] = {"n": sum(counts.values()), "n_effective": n_eff, "advantage_points": delta,
                            "margin_points": margin_points, "expected_discordance": q, "power": power,
                            "required_power": target, "effective_cases_needed": needed, "sufficient": power >= target}
    if growth.get("first_cohort_margin_points"):
        n = sum(first_counts.values())
        q, margin, target = (growth["first_cohort_expected_discordance"], growth["first_cohort_margin_points"],
                             growth["first_cohort_power"])
        floor = cases_for_one_loss(margin, confidence)  # below it, a pass comes only from no discordant case
        power = pass_probability(n, q, margin, confidence) if n >= 2 else 0.0
        needed = cases_for_power(q, margin, confidence, target, at_least=floor)
        out["first_cohort"] = {"n": n, "margin_points": margin, "expected_discordance": q, "power": power,
                               "required_power": target, "cases_needed": needed,
                               "sufficient": power >= target and n >= floor}
    out["sufficient"] = all(part["sufficient"] for part in (out["advantage"], out["first_cohort"]) if part)
    return out


def declaration_lines(declared: dict) -> list[str]:
    """The declaration in words, one line per screen (the study prints them before training; the report repeats
    them)."""
    lines = []
    a, f = declared.get("advantage"), declared.get("first_cohort")
    if a:
        weights = (f", family-stratified with declared weights {declared['family_weights']} (effective n "
                   f"{a['n_effective']:,.0f})" if declared.get("family_weights") else "")
        lines.append(f"- advantage screen: grown − continued dense over {a['n']:,} fresh cases{weights}, lower bound "
                     f"> {a['margin_points']:+g} points; at a true advantage of {a['advantage_points']:+g} points and "
                     f"development discordance {100 * a['expected_discordance']:.2f}% it passes with probability "
                     f"{100 * a['power']:.1f}% (required {100 * a['required_power']:.0f}%: an effective "
                     f"{a['effective_cases_needed']:,} cases)")
    if f:
        lines.append(f"- first-cohort sub-screen: grown − continued dense over the first cohort's {f['n']:,} cases, "
                     f"lower bound > {f['margin_points']:+g} points; an equal candidate at development discordance "
                     f"{100 * f['expected_discordance']:.2f}% passes with probability {100 * f['power']:.1f}% "
                     f"(required {100 * f['required_power']:.0f}%: {f['cases_needed']:,} cases)")
    return lines


def stratified_bounds(candidate: dict[str, bool], control: dict[str, bool], family_of: dict[str, str],
                      weights: dict[str, float], confidence: float) -> dict:
    """Candidate minus control, family-stratified: sum_f w_f x mean_f, with variance sum_f w_f^2 x s_f^2 / n_f (s_f
    each family's sample deviation of the per-case differences), in points."""
    if set(candidate) != set(control):
        raise PairingError("the arms hold different case IDs; pair models scored on the same cases")
    by_family: dict[str, list[float]] = {}
    for case in sorted(candidate):
        by_family.setdefault(family_of[case], []).append(float(candidate[case]) - float(control[case]))
    check_weights({f: len(v) for f, v in by_family.items()}, weights)
    estimate = variance = 0.0
    for family, diffs in by_family.items():
        if len(diffs) < 2:
            raise PairingError(f"family {family} has {len(diffs)} case: a stratum needs at least 2")
        mean = math.fsum(diffs) / len(diffs)
        s2 = math.fsum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
        estimate += weights[family] * mean
        variance += weights[family] ** 2 * s2 / len(diffs)
    half = two_sided_z(confidence) * math.sqrt(variance)
    return {"n": len(candidate), "stratified": True, "family_weights": weights, "confidence": confidence,
            "discordant": sum(1 for c in candidate if candidate[c] != control[c]),
            "difference_points": 100 * estimate, "lower_points": 100 * (estimate - half),
            "upper_points": 100 * (estimate + half)}


def _correct(rows: list[dict], families=None) -> dict[str, bool]:
    return {r["case_id"]: r["correct"] for r in rows if families is None or r["family"] in families}


def advantage_bounds(candidate_rows: list[dict], control_rows: list[dict], weights: dict[str, float],
                     confidence: float) -> dict:
    """The advantage screen's family-stratified bounds over every fresh case (stratified_bounds)."""
    return stratified_bounds(_correct(candidate_rows), _correct(control_rows),
                             {r["case_id"]: r["family"] for r in candidate_rows}, weights, confidence)


def first_cohort_bounds(candidate_rows: list[dict], control_rows: list[dict], families: list[str],
                        confidence: float) -> dict:
    """The first-cohort sub-screen's paired bounds, grown against continued dense on the first cohort's families
    (no bound, and so no pass, with fewer than two cases)."""
    try:
        return paired_bounds(_correct(candidate_rows, set(families)), _correct(control_rows, set(families)),
                             confidence)
    except (PairingError, ValueError):
        return {"lower_points": None}
