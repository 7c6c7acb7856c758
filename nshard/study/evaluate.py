"""Score one model on a run's prepared sets: greedy answers on the fresh cases, loss on the retention documents;
with own data, loss per response token on the held-out rows and greedy exact match on those with an expected answer.

    python -m nshard.study.evaluate --run RUN_DIR --model MODEL_DIR --label NAME --out EVAL_DIR \
        (--commitment COMMITMENT.json | --exploratory) [--seed-eval SEED_EVAL_DIR]

Writes EVAL_DIR/cases.jsonl (one line per case; an own held-out row with an expected answer is a case of family
"chat"), retention.jsonl (one line per retention document), heldout.jsonl (one line per own held-out row) and
summary.json, written last: a directory without summary.json was not finished.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nshard import tasks
from nshard.files import write_json_atomic, write_jsonl_atomic

CASE_ID = re.compile(r"^(?P<family>[a-z_]+)-s(?P<seed>\d+)-(?P<index>\d+)$")


class EvalError(RuntimeError):
    """An evaluation that must not go on; the message names the model, case or file."""


@dataclass(frozen=True)
class RunSets:
    """What a run fixed for evaluation: the fresh cases and the retention documents (tokens and weights)."""

    prepared_identity: str
    cases: list
    retention: list[dict]
    heldout: list[dict] = ()
    """Own held-out rows (tokens, weights; prompt_ids and expected where the row carries an answer)."""

    @property
    def answers(self) -> list[dict]:
        """The held-out rows scored by greedy exact match."""
        return [d for d in self.heldout if d.get("prompt_ids") is not None]


def exact_match(text: str, expected: str) -> bool:
    """An own row's greedy answer against its expected answer, both stripped of surrounding whitespace."""
    return text.strip() == expected.strip()


def heldout_summary(rows: list[dict]) -> dict | None:
    """Loss per response token over the held-out rows, normalized as in training: sum of weight x NLL over all rows
    divided by their total target weight."""
    if not rows:
        return None
    nll, weight = math.fsum(r["nll_sum"] for r in rows), math.fsum(r["target_weight"] for r in rows)
    return {"docs": len(rows), "nll_sum": nll, "target_weight": weight, "loss_per_token": nll / weight}


def case_from_id(case_id: str):
    """Rebuild a case from its stable ID alone (family, seed, index), and check the ID round-trips."""
    m = CASE_ID.match(case_id)
    if not m or m["family"] not in tasks.FAMILIES:
        raise EvalError(f"case id {case_id!r} is not of the form FAMILY-sSEED-INDEX with a known family")
    case = tasks.family_module(m["family"]).generate(int(m["seed"]), int(m["index"]))
    if case.case_id != case_id:
        raise EvalError(f"case id {case_id!r} regenerates as {case.case_id!r}")
    return case


def load_run_sets(run_dir: Path) -> RunSets:
    """The evaluation cases and retention documents of a finished run's prepared/ directory."""
    prepared = Path(run_dir) / "prepared"
    if not (prepared / "identity.json").is_file():
        raise EvalError(f"{prepared} is incomplete (no identity.json); evaluate a finished run")
    identity = json.loads((prepared / "identity.json").read_text())["prepared_identity"]
    sets = json.loads((prepared / "sets.json").read_text())
    cases = [case_from_id(c) for c in sets["eval_case_ids"]]
    heldout_ids = (sets.get("chat") or {}).get("heldout_ids", [])
    wanted = set(sets["retention_ids"]) | set(heldout_ids)
    docs = {}
    with (prepared / "documents.jsonl").open() as f:
        for line in f:
            d = json.loads(line)
            if d["doc_id"] in wanted:
                docs[d["doc_id"]] = d
    missing = wanted - set(docs)
    if missing:
        raise EvalError(f"retention or held-out document {sorted(missing)[0]} is not in {prepared}/documents.jsonl")
    return RunSets(identity, cases, [docs[i] for i in sets["retention_ids"]], [docs[i] for i in heldout_ids])


def run_placement(run_dir: Path):
    """Evaluate where and as the run trained: its GPU or the CPU, in bf16 when it trained in bf16, else fp32
    (nshard/run/device.py); the run's ds_config.json says whether it trained in bf16."""
    from nshard.run.device import cuda_available, inference_placement
    from nshard.seam.ds_config import _bf16

    path = Path(run_dir) / "ds_config.json"
    if not path.is_file():
        raise EvalError(f"{path} is missing: evaluate a run directory written by nshard/train.py")
    return inference_placement(_bf16(json.loads(path.read_text())), cuda_available(), cpu_bf16=True)


def prompt_ids(tokenizer, case) -> list[int]:
    """The model input: the case's prompt as the user turn, then the assistant header (no answer)."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": tasks.prompt(case)}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    if "<|im_end|>" in tokenizer.get_vocab():
        ids.add(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return sorted(i for i in ids if i is not None)


def generate_answers(model, tokenizer, inputs: list[list[int]], max_new_tokens: int, batch_size: int,
                     desc: str = "generate") -> list[list[int]]:
    """Greedy continuations, batched and left-padded; each is cut before its first stop token."""
    import torch
    from tqdm import tqdm

    stops = stop_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    # Longest first, so each batch pads little; answers go back to their input's position.
    order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i]), i))
    answers: list[list[int]] = [[] for _ in inputs]
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        rows = order[start:start + batch_size]
        width = max(len(inputs[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(inputs[i]):] = torch.tensor(inputs[i])
            mask[r, width - len(inputs[i]):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 eos_token_id=stops, pad_token_id=pad)
        for r, i in enumerate(rows):
            new = out[r, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in stops), len(new))
            answers[i] = new[:cut]
    return answers


def retention_losses(model, retention: list[dict], desc: str = "retention") -> list[dict]:
    """Summed weighted NLL of each retention document's target tokens (its own weights, as in training)."""
    import torch
    from tqdm import tqdm

    from nshard.run.loss import weighted_nll_sum

    out = []
    for doc in tqdm(retention, desc=desc, unit="doc"):
        ids = torch.tensor([doc["input_ids"]], device=model.device)
        weights = torch.tensor([doc["weights"]], dtype=torch.float32, device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            nll = weighted_nll_sum(logits, ids, weights).item()
        out.append({"doc_id": doc["doc_id"], "nll_sum": nll, "target_weight": math.fsum(doc["weights"][1:]),
                    "target_tokens": sum(1 for w in doc["weights"][1:] if w > 0)})
    return out


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def score_model(label: str, model_dir: Path, run_dir: Path, out: Path, *, commitment: Path | None,
                exploratory: bool = False, seed_eval: Path | None = None, max_new_tokens: int = 48,
                batch_size: int = 16) -> dict:
    """Evaluate one model directory; refuses a model that the commitment does not name unless exploratory."""
    import torch

    from nshard.evidence import commit as commit_mod
    from nshard.run.device import load_for_inference
    from nshard.run.models import ModelRef, load_tokenizer

    model_dir = Path(model_dir)
    files = commit_mod.model_files(model_dir)
    if exploratory:
        committed = {"commitment": None, "exploratory": True}
    else:
        if commitment is None:
            raise EvalError(f"{label}: no commitment given; commit the candidates first "
                            "(python -m nshard.evidence.commit) or pass --exploratory")
        record = commit_mod.load_commitment(commitment)
        name = commit_mod.committed_name(record, files)
        if name is None:
            raise EvalError(f"{label}: model {model_dir} is not named by commitment {commitment} (record "
                            f"{record['record_sha256'][:12]}); its files changed after the commitment, or it was "
                            "never committed. Commit it with the other candidates first, or pass --exploratory "
                            "(every output then says exploratory)")
        commit_mod.check_committed_as(record, label, files)  # a committed model scored under another label
        committed = {"commitment": record["record_sha256"], "committed_as": label, "exploratory": False}
    sets = load_run_sets(run_dir)
    seed_by_doc = None
    if seed_eval is not None:
        seed_by_doc = {r["doc_id"]: r for r in read_jsonl(Path(seed_eval) / "retention.jsonl")}

    ref = ModelRef(str(model_dir), str(model_dir.resolve()), None, "local")
    tokenizer = load_tokenizer(ref)
    placement = run_placement(run_dir)
    model = load_for_inference(ref, placement)
    t0 = time.perf_counter()
    inputs = [prompt_ids(tokenizer, c) for c in sets.cases] + [d["prompt_ids"] for d in sets.answers]
    generated = generate_answers(model, tokenizer, inputs, max_new_tokens, batch_size, desc=f"{label}: answers")
    generate_s = time.perf_counter() - t0
    case_rows = []
    for case, ids, gen in zip(sets.cases + sets.answers, inputs, generated):
        text = tokenizer.decode(gen, skip_special_tokens=True)
        if isinstance(case, dict):  # an own held-out row with an expected answer
            row = {"case_id": case["doc_id"], "family": "chat", "prompt": None, "expected": case["expected"],
                   "correct": exact_match(text, case["expected"])}
        else:
            row = {"case_id": case.case_id, "family": case.family, "prompt": tasks.prompt(case),
                   "expected": tasks.answer(case), "correct": tasks.score(case, text)}
        case_rows.append({**row, "input_ids": ids, "generated_text": text, "generated_ids": gen,
                          "exploratory": exploratory})
    t1 = time.perf_counter()
    retention = retention_losses(model, sets.retention, desc=f"{label}: retention")
    for row in retention:
        if seed_by_doc is not None:
            seed = seed_by_doc[row["doc_id"]]
            row["seed_nll_sum"] = seed["nll_sum"]
            row["change_nats_per_token"] = (row["nll_sum"] - seed["nll_sum"]) / row["target_weight"]
        row["exploratory"] = exploratory
    heldout = retention_losses(model, sets.heldout, desc=f"{label}: held-out")
    for row in heldout:
        row["exploratory"] = exploratory
    retention_s = time.perf_counter() - t1

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # the old summary must not vouch for new lines
    write_jsonl_atomic(out / "cases.jsonl", case_rows)
    write_jsonl_atomic(out / "retention.jsonl", retention)
    write_jsonl_atomic(out / "heldout.jsonl", heldout)
    per_family = {}
    for row in case_rows:
        fam = per_family.setdefault(row["family"], {"correct": 0, "cases": 0})
        fam["cases"] += 1
        fam["correct"] += bool(row["correct"])
    summary = {"label": label, "model_dir": str(model_dir), "model_files": files,
               "prepared_identity": sets.prepared_identity, "run_dir": str(run_dir), **committed,
               "cases": len(case_rows), "correct": sum(r["correct"] for r in case_rows), "per_family": per_family,
               "retention_docs": len(retention), "heldout": heldout_summary(heldout),
               "max_new_tokens": max_new_tokens, "batch_size": batch_size,
               "generate_s": generate_s, "retention_s": retention_s,
               "device": placement.device, "dtype": placement.dtype, "threads": torch.get_num_threads(),
               "with_seed_retention": seed_eval is not None}
    write_json_atomic(out / "summary.json", summary)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="run directory whose prepared/ sets are scored")
    parser.add_argument("--model", required=True, type=Path, help="model directory (transformers, safetensors)")
    parser.add_argument("--label", required=True, help="name of this model in the outputs")
    parser.add_argument("--out", required=True, type=Path, help="evaluation directory to write")
    parser.add_argument("--commitment", type=Path, help="commitment record that must name the model")
    parser.add_argument("--exploratory", action="store_true", help="score without a commitment; outputs say so")
    parser.add_argument("--seed-eval", type=Path, help="the seed model's evaluation dir (retention change)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    from nshard.evidence.commit import CommitError

    try:
        summary = score_model(args.label, args.model, args.run, args.out, commitment=args.commitment,
                              exploratory=args.exploratory, seed_eval=args.seed_eval,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    except (EvalError, CommitError, OSError) as exc:
        print(f"nshard.study.evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({**{k: summary[k] for k in ("label", "cases", "correct", "exploratory")},
                      "heldout_loss_per_token": (summary["heldout"] or {}).get("loss_per_token")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
