"""Score one model on a run's prepared sets: greedy answers on the fresh cases, loss on the retention documents;
with own data, loss per response token on the held-out rows and greedy exact match on those with an expected answer.

    python -m nshard.study.evaluate --run RUN_DIR --model MODEL_DIR --label NAME --out EVAL_DIR \
        (--commitment COMMITMENT.json | --exploratory) [--seed_eval SEED_EVAL_DIR]

Writes EVAL_DIR/cases.jsonl (one line per case; an own held-out row with an expected answer is a case of family
"chat"), retention.jsonl (one line per retention document), heldout.jsonl (one line per own held-out row) and
summary.json, written last: a directory without summary.json was not finished.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nshard import tasks
from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
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
    retention_heldout: list[dict] = ()
    """Held-out retention documents (data.heldout_retention_docs): scored as the retention documents are, never trained."""

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
    retention_heldout_ids = sets.get("retention_heldout_ids", [])
    wanted = set(sets["retention_ids"]) | set(heldout_ids) | set(retention_heldout_ids)
    docs = {}
    with (prepared / "documents.jsonl").open() as f:
        for line in f:
            d = json.loads(line)
            if d["doc_id"] in wanted:
                docs[d["doc_id"]] = d
    missing = wanted - set(docs)
    if missing:
        raise EvalError(f"retention or held-out document {sorted(missing)[0]} is not in {prepared}/documents.jsonl")
    return RunSets(identity, cases, [docs[i] for i in sets["retention_ids"]], [docs[i] for i in heldout_ids],
                   [docs[i] for i in retention_heldout_ids])


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
    """EOS and the token that closes a chat turn (the one training weighs last: nshard.run.data.end_of_turn_id)."""
    from nshard.run.data import end_of_turn_id

    return sorted(i for i in {tokenizer.eos_token_id, end_of_turn_id(tokenizer)} if i is not None)


def scoring_batches(inputs: list[list[int]], batch_size: int) -> list[list[int]]:
    """The positions of the inputs each scoring batch holds: longest input first, so each batch pads little."""
    order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i]), i))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def greedy_batch(model, rows: list[list[int]], max_new_tokens: int, stops: list[int], pad: int,
                 still_possible=None) -> list[tuple[list[int], bool]]:
    """Greedy continuations of one batch, left-padded, each up to (not including) its first stop token or
    max_new_tokens long, with whether it was cut: `still_possible(row, ids)` False means no continuation of the
    row's answer so far can be scored right, so it ends there (its last token is the one that made it wrong). A row
    leaves the batch and the KV cache once it ended, so the batch narrows as its answers end. Every step is the
    model's argmax; which rows share a step is fixed by the batch, so the same batch, dtype, device and thread count
    give the same tokens."""
    import torch
    from transformers import DynamicCache

    device = model.device
    # transformers renames the cache argument within 5.x (past_key_values, deprecated for `cache` from 5.25).
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    ids, mask = ids.to(device), mask.to(device)
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = DynamicCache(config=model.config)
    stop = torch.tensor(stops, device=device)
    answers: list[list[int]] = [[] for _ in rows]
    cut = [False] * len(rows)
    alive = list(range(len(rows)))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1,
                       **{cache_arg: cache}).logits[:, -1]
        position = position[:, -1:] + 1
        for step in range(max_new_tokens):
            token = logits.argmax(-1)
            ended = torch.isin(token, stop).tolist()
            for k, (row, t) in enumerate(zip(alive, token.tolist())):
                if not ended[k]:
                    answers[row].append(t)
                    if still_possible is not None and not still_possible(row, answers[row]):
                        cut[row] = ended[k] = True
            if step == max_new_tokens - 1 or all(ended):
                break
            if any(ended):
                keep = torch.tensor([k for k, end in enumerate(ended) if not end], device=device)
                cache.batch_select_indices(keep)
                mask, token, position = mask[keep], token[keep], position[keep]
                alive = [row for row, end in zip(alive, ended) if not end]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, use_cache=True,
                           **{cache_arg: cache}).logits[:, -1]
            position = position + 1
    return list(zip(answers, cut))


def answer_target(family: str, expected: str) -> tuple[str, bool]:
    """What an answer is matched against: a task case's answer under exact_match (one trailing period forgiven),
    an own row's expected answer with surrounding whitespace forgiven only (evaluate.exact_match)."""
    return (expected.strip(), False) if family == "chat" else (expected, True)


def generate_answers(model, tokenizer, inputs: list[list[int]], max_new_tokens: int, batch_size: int,
                     desc: str = "generate", batches: list[int] | None = None,
                     targets: list[tuple[str, bool]] | None = None) -> dict[int, tuple[list[int], bool]]:
    """Greedy answers (greedy_batch) to the inputs of the scoring batches numbered `batches` (None: all), by input
    position: (token ids, cut). With `targets` ((expected, period) per input, answer_target) an answer ends as soon
    as no continuation could match its target: scoring is exact match, so its verdict is already wrong, and the
    rest of it would cost decoding steps and change nothing that is scored. (Only where decoding a prefix of the
    ids gives a prefix of the whole text: a tokenizer that cleans up spaces on decoding is never cut.)"""
    from tqdm import tqdm

    from nshard.tasks.base import could_still_match

    stops = stop_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    every = scoring_batches(inputs, batch_size)
    chosen = range(len(every)) if batches is None else batches
    cuttable = targets is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    answers: dict[int, tuple[list[int], bool]] = {}
    for number in tqdm(chosen, desc=desc, unit="batch"):
        rows = every[number]

        def still_possible(k: int, ids: list[int]) -> bool:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            # A trailing incomplete character decodes as U+FFFD and is not yet text: wait for the next token.
            expected, period = targets[rows[k]]
            return text.endswith("\ufffd") or could_still_match(expected, text, period)

        answers.update(zip(rows, greedy_batch(model, [inputs[i] for i in rows], max_new_tokens, stops, pad,
                                              still_possible if cuttable else None)))
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


@dataclass(frozen=True)
class Scoring:
    """One model to score, checked against the commitment: its sets, tokenizer, placement and the model inputs."""

    label: str
    model_dir: Path
    run_dir: Path
    files: dict
    committed: dict
    sets: RunSets
    tokenizer: object
    placement: object
    inputs: list
    targets: list
    """(expected, period) per input: what its answer must match (answer_target)."""

    def shares(self, max_new_tokens: int, batch_size: int, processes: int) -> list[tuple]:
        """score_share's arguments for each of `processes` processes: every processes-th scoring batch, and the first
        one's the retention and held-out losses."""
        batches = len(scoring_batches(self.inputs, batch_size))
        return [(str(self.model_dir), self.placement, self.inputs, self.targets, max_new_tokens, batch_size,
                 list(range(k, batches, processes)),
                 {"retention": self.sets.retention, "heldout": list(self.sets.heldout),
                  "retention_heldout": list(self.sets.retention_heldout)} if k == 0 else {})
                for k in range(processes)]


def prepare_scoring(label: str, model_dir: Path, run_dir: Path, *, commitment: Path | None,
                    exploratory: bool = False) -> Scoring:
    """Refuses a model that the commitment does not name (unless exploratory); else its sets and inputs."""
    from nshard.evidence import commit as commit_mod
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
    tokenizer = load_tokenizer(ModelRef(str(model_dir), str(model_dir.resolve()), None, "local"))
    inputs = [prompt_ids(tokenizer, c) for c in sets.cases] + [d["prompt_ids"] for d in sets.answers]
    targets = ([answer_target(c.family, tasks.answer(c)) for c in sets.cases]
               + [answer_target("chat", d["expected"]) for d in sets.answers])
    return Scoring(label, model_dir, Path(run_dir), files, committed, sets, tokenizer, run_placement(run_dir), inputs,
                   targets)


def score_share(model_dir: str, placement, inputs: list[list[int]], targets: list[tuple[str, bool]],
                max_new_tokens: int, batch_size: int, batches: list[int], loss_sets: dict[str, list[dict]]) -> dict:
    """One process's share of one model's scoring: the greedy answers of the scoring batches numbered `batches`,
    and the losses of each of `loss_sets` (name -> documents). Loads the model and tokenizer itself, so it can run
    in a process of its own (side_by_side)."""
    import torch

    from nshard.run.device import load_for_inference
    from nshard.run.models import ModelRef, load_tokenizer

    ref = ModelRef(model_dir, str(Path(model_dir).resolve()), None, "local")
    tokenizer = load_tokenizer(ref)
    model = load_for_inference(ref, placement)
    name = Path(model_dir).parent.name if Path(model_dir).name == "model" else Path(model_dir).name
    t0 = time.perf_counter()
    answers = generate_answers(model, tokenizer, inputs, max_new_tokens, batch_size, desc=f"{name}: answers",
                               batches=batches, targets=targets)
    t1 = time.perf_counter()
    losses = {what: retention_losses(model, docs, desc=f"{name}: {what}") for what, docs in loss_sets.items()}
    return {"answers": answers, "generate_s": t1 - t0, "losses": losses, "loss_s": time.perf_counter() - t1,
            "threads": torch.get_num_threads()}


def write_scores(scoring: Scoring, shares: list[dict], out: Path, *, exploratory: bool = False,
                 seed_rows: list[dict] | None = None, max_new_tokens: int, batch_size: int,
                 seed_heldout_rows: list[dict] | None = None) -> dict:
    """The model's answers (from every share) decoded and scored, and its losses, into EVAL_DIR; summary.json last.
    seed_rows, seed_heldout_rows: the seed's retention and held-out retention losses (None: this is the seed)."""
    answers = {i: a for share in shares for i, a in share["answers"].items()}
    if sorted(answers) != list(range(len(scoring.inputs))):
        raise EvalError(f"{scoring.label}: the scoring processes answered {len(answers)} of {len(scoring.inputs)} "
                        "inputs")
    threads = {share["threads"] for share in shares}
    if len(threads) != 1:
        raise EvalError(f"{scoring.label}: scored at several thread counts {sorted(threads)}; the bits depend on it")
    sets, tokenizer = scoring.sets, scoring.tokenizer
    case_rows = []
    for position, (case, ids) in enumerate(zip(sets.cases + sets.answers, scoring.inputs)):
        gen, cut = answers[position]
        text = tokenizer.decode(gen, skip_special_tokens=True)
        if isinstance(case, dict):  # an own held-out row with an expected answer
            row = {"case_id": case["doc_id"], "family": "chat", "prompt": None, "expected": case["expected"],
                   "correct": exact_match(text, case["expected"])}
        else:
            row = {"case_id": case.case_id, "family": case.family, "prompt": tasks.prompt(case),
                   "expected": tasks.answer(case), "correct": tasks.score(case, text)}
        if cut and row["correct"]:
            raise EvalError(f"{scoring.label}: {row['case_id']}: an answer cut as unmatchable scores right: the "
                            "tokenizer's decoding of a prefix is not a prefix of its decoding of the whole")
        case_rows.append({**row, "input_ids": ids, "generated_text": text, "generated_ids": gen, "cut": cut,
                          "exploratory": exploratory})
    losses = next(share["losses"] for share in shares if share["losses"])
    retention = [{**row, "exploratory": exploratory} for row in losses["retention"]]
    heldout = [{**row, "exploratory": exploratory} for row in losses["heldout"]]
    retention_heldout = [{**row, "exploratory": exploratory} for row in losses.get("retention_heldout", [])]
    if seed_rows is not None:
        retention = with_seed_retention(retention, seed_rows)
        retention_heldout = with_seed_retention(retention_heldout, seed_heldout_rows or [])

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # the old summary must not vouch for new lines
    write_jsonl_atomic(out / "cases.jsonl", case_rows)
    write_jsonl_atomic(out / "retention.jsonl", retention)
    write_jsonl_atomic(out / "heldout.jsonl", heldout)
    write_jsonl_atomic(out / "retention_heldout.jsonl", retention_heldout)
    per_family = {}
    for row in case_rows:
        fam = per_family.setdefault(row["family"], {"correct": 0, "cases": 0})
        fam["cases"] += 1
        fam["correct"] += bool(row["correct"])
    summary = {"label": scoring.label, "model_dir": str(scoring.model_dir), "model_files": scoring.files,
               "prepared_identity": sets.prepared_identity, "run_dir": str(scoring.run_dir), **scoring.committed,
               "cases": len(case_rows), "correct": sum(r["correct"] for r in case_rows), "per_family": per_family,
               "retention_docs": len(retention), "retention_heldout_docs": len(retention_heldout),
               "heldout": heldout_summary(heldout),
               "max_new_tokens": max_new_tokens, "batch_size": batch_size,
               "generate_s": sum(share["generate_s"] for share in shares),
               "retention_s": sum(share["loss_s"] for share in shares), "processes": len(shares),
               "cut": sum(r["cut"] for r in case_rows),
               "device": scoring.placement.device, "dtype": scoring.placement.dtype, "threads": threads.pop(),
               "with_seed_retention": seed_rows is not None}
    write_json_atomic(out / "summary.json", summary)
    return summary


def score_model(label: str, model_dir: Path, run_dir: Path, out: Path, *, commitment: Path | None,
                exploratory: bool = False, seed_eval: Path | None = None, max_new_tokens: int = 48,
                batch_size: int = 16) -> dict:
    """Evaluate one model directory in this process; refuses a model that the commitment does not name unless
    exploratory. (A study scores its models side by side: nshard/study/runner.py score_all.)"""
    scoring = prepare_scoring(label, model_dir, run_dir, commitment=commitment, exploratory=exploratory)
    seed_rows = read_jsonl(Path(seed_eval) / "retention.jsonl") if seed_eval is not None else None
    seed_heldout = read_seed_heldout(Path(seed_eval)) if seed_eval is not None else None
    share = score_share(*scoring.shares(max_new_tokens, batch_size, 1)[0])
    return write_scores(scoring, [share], out, exploratory=exploratory, seed_rows=seed_rows,
                        max_new_tokens=max_new_tokens, batch_size=batch_size, seed_heldout_rows=seed_heldout)


def read_seed_heldout(seed_eval: Path) -> list[dict]:
    """The seed's held-out retention losses (none where its evaluation predates them or the run has none)."""
    path = Path(seed_eval) / "retention_heldout.jsonl"
    return read_jsonl(path) if path.is_file() else []


def with_seed_retention(rows: list[dict], seed_rows: list[dict]) -> list[dict]:
    """Each retention row with the seed's loss of the same document and the change per target token."""
    seed_by_doc = {r["doc_id"]: r for r in seed_rows}
    out = []
    for row in rows:
        seed = seed_by_doc[row["doc_id"]]["nll_sum"]
        out.append({**row, "seed_nll_sum": seed, "change_nats_per_token": (row["nll_sum"] - seed) / row["target_weight"]})
    return out


SIDE_BY_SIDE_MIN_STEPS = 4096
"""Below this many decoding steps per model (cases x max_new_tokens, about 100 cases of 40 tokens) a model is scored
in this process: starting a process and importing torch there costs a few CPU seconds, about what such a model's
scoring takes on the embedded model."""


def side_by_side_layout(cases: int, batch_size: int, max_new_tokens: int, cuda: bool) -> tuple[int, int | None]:
    """How many processes share a model's scoring (or regeneration) batches, and each one's threads (None: one
    process, as is). On a GPU one process: the device is shared. On a CPU one process per core, at most one per
    batch, each with an equal share of the cores, where the scoring is worth it (SIDE_BY_SIDE_MIN_STEPS): on the
    2-core build machine two one-thread processes answer 1.1 to 1.25x as many cases per second as one process on both
    cores at batch 64, and no OpenMP thread waits on a core the other holds (docs/benchmarks.md#greedy-scoring-time-per-model). The thread count
    is recorded with every score (summary.json "threads") and validation regenerates at it: bf16 kernels may split
    their sums by thread."""
    from nshard.seam.launch_env import usable_cores

    cores = usable_cores()
    batches = -(-cases // batch_size)
    worth = cases * max_new_tokens >= SIDE_BY_SIDE_MIN_STEPS
    processes = 1 if cuda or not worth else max(1, min(batches, cores))
    return processes, (cores // processes if processes > 1 else None)


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def side_by_side(fn, jobs: list[tuple], processes: int, threads: int | None) -> list:
    """fn(*job) for every job, in `processes` spawned processes of `threads` threads each (one process: here, as
    is); results in job order. The first job that raised (in job order) raises here; jobs not yet started are
    cancelled."""
    if processes <= 1:
        return [fn(*job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the spawned processes inherit it before they import torch
    try:
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_set_threads, initargs=(threads,)) as pool:
            futures = [pool.submit(fn, *job) for job in jobs]
            try:
                return [f.result() for f in futures]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.study.evaluate"), description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("--run", required=True, type=Path, help="run directory whose prepared/ sets are scored")
    parser.add_argument("--model", required=True, type=Path, help="model directory (transformers, safetensors)")
    parser.add_argument("--label", required=True, help="name of this model in the outputs")
    parser.add_argument("--out", required=True, type=Path, help="evaluation directory to write")
    parser.add_argument("--commitment", type=Path, help="commitment record that must name the model")
    parser.add_argument("--exploratory", action="store_true", help="score without a commitment; outputs say so")
    parser.add_argument("--seed_eval", type=Path, help="the seed model's evaluation dir (retention change)")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--batch_size", type=int, default=16)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
