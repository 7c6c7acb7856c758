"""A growth study's screen and tables (docs/growth.md#the-growth-study): the grown candidate against continued dense
training under one budget. Reads what nshard.analysis.report has gathered and the study's files only.

The screen, declared in the plan before either arm runs:
- a quality advantage over every continued-dense arm: the paired lower bound of the accuracy difference on all
  fresh cases above screens.min_growth_paired_lower_points (0: more parameters alone do not pass);
- the retention-change upper bound against the accepted checkpoint (this study's seed) below the screen;
- the first cohort's families, paired against the accepted checkpoint, above screens.min_paired_lower_points.
"""

from __future__ import annotations

import json
from pathlib import Path


def growth_screen(candidate: dict, comparisons: list[dict], cohort_quality: dict, screens: dict,
                  growth: dict) -> dict:
    """The conditions above; cohort_quality is the cohort screen's (its first-cohort and retention conditions)."""
    if candidate["status"] != "complete":
        return cohort_quality
    conf = f"{screens['confidence']:.0%}"
    dense = [name for name, arm in growth["arms"].items() if not arm["grown"]]
    conds = []
    for c in comparisons:
        if c["control"] in dense:
            conds.append({"name": f"paired {conf} lower bound vs {c['control']} (continued dense), points",
                          "value": c["lower_points"], "threshold": screens["min_growth_paired_lower_points"],
                          "rule": f"> {screens['min_growth_paired_lower_points']}",
                          "passed": c["lower_points"] > screens["min_growth_paired_lower_points"]})
    missing = [name for name in dense if name not in {c["control"] for c in comparisons}]
    for name in missing:
        conds.append({"name": f"paired lower bound vs {name} (continued dense)", "value": None, "passed": False,
                      "rule": "the continued-dense arm must finish"})
    conds += [c for c in cohort_quality["conditions"] if not c["name"].startswith("new-task accuracy gain")]
    return {"passed": all(c["passed"] for c in conds), "conditions": conds,
            "first_cohort_paired": cohort_quality.get("first_cohort_paired")}


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
