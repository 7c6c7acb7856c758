"""The lm-eval recipe (docs/evidence.md, "Scoring an export with lm-eval"): EleutherAI's harness with its HF backend
scores an nshard export on a task of our own (a JSONL file and a task YAML, no hub), offline, and the score is the
one the export's own weights give; a broken export fails loudly, before and inside the harness."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runs import cached_run, run_env, tiny_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                 reason="lm-eval is not installed: pip install -e '.[eval]' (pyproject's eval extra)")]

ITEMS = [("Paris is the capital of", ["France", "numbers", "the table"]),
         ("We sort the numbers from the smallest to the", ["largest", "city", "invoice"]),
         ("A model learns to read a", ["table", "Tokyo", "99"]),
         ("Berlin, Madrid, Tokyo and Cairo are", ["cities too", "numbers", "sorted"]),
         ("0 1 2 3 4", ["5", "city", "France"]),
         ("The table shows the name, the age and the", ["city", "invoice", "largest"])]
TASK = """task: nshard_own
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(where: Path) -> Path:
    """The documented layout: a JSONL of items and, beside it, a task YAML whose dataset_path is json."""
    where.mkdir(parents=True)
    items = where / "items.jsonl"
    items.write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n" for q, c in ITEMS))
    (where / "nshard_own.yaml").write_text(TASK.format(items=items))
    return where


def lm_eval(export: Path, tasks: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={export},dtype=float32",
           "--device", "cpu", "--tasks", "nshard_own", "--include_path", str(tasks), "--batch_size", "1",
           "--output_path", str(out), "--log_samples"]
    return subprocess.run(cmd, env=run_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}), capture_output=True,
                          text=True, timeout=600)


def our_loglikelihoods(export: Path) -> list[list[float]]:
    """Each choice's summed log-probability after its question, from the export's weights with transformers alone:
    the continuation is " " + choice, its tokens those that encoding question + continuation adds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, local_files_only=True).eval()
    scores = []
    for question, choices in ITEMS:
        context = tokenizer(question)["input_ids"]
        row = []
        for choice in choices:
            whole = tokenizer(question + " " + choice)["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits[len(context) - 1:-1], -1)
            row.append(logprobs.gather(-1, torch.tensor(whole[len(context):]).unsqueeze(-1)).sum().item())
        scores.append(row)
    return scores


def test_lm_eval_scores_an_export_on_a_local_task_with_the_exports_own_weights(runs_root, tmp_path):
    export = cached_run(runs_root, "ds-dense", tiny_config()) / "model"
    proc = lm_eval(export, write_task(tmp_path / "tasks"), tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["n-samples"]["nshard_own"] == {"original": len(ITEMS), "effective": len(ITEMS)}
    acc = results["results"]["nshard_own"]["acc,none"]
    samples = sorted((json.loads(line) for line in next((tmp_path / "out").rglob("samples_nshard_own_*.jsonl"))
                      .read_text().splitlines()), key=lambda s: s["doc_id"])
    theirs = [[float(resp[0][0]) for resp in s["resps"]] for s in samples]
    ours = our_loglikelihoods(export)
    torch.testing.assert_close(torch.tensor(theirs), torch.tensor(ours), rtol=1e-4, atol=1e-4)
    assert acc == sum(row.index(max(row)) == 0 for row in ours) / len(ITEMS)


def test_a_broken_export_fails_the_manifest_check_and_the_harness(runs_root, tmp_path):
    from nshard.evidence.export import ManifestError, verify_manifest

    broken = tmp_path / "broken"
    shutil.copytree(cached_run(runs_root, "ds-dense", tiny_config()) / "model", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    with pytest.raises(ManifestError, match="model.safetensors"):
        verify_manifest(broken)
    proc = lm_eval(broken, write_task(tmp_path / "tasks"), tmp_path / "out")
    assert proc.returncode != 0
    assert "safetensors" in (proc.stdout + proc.stderr).lower() or "error" in proc.stderr.lower()
    assert not list((tmp_path / "out").rglob("results_*.json"))
