"""A growth study's table (docs/growth.md#the-growth-study): the grown candidate against continued dense training
under one budget, what each arm cost to train and costs to serve. Reads what nshard.analysis.report has gathered
and the study's serving.json only; the growth screen is nshard.analysis.report's growth_screen."""

from __future__ import annotations

import json
from pathlib import Path


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
