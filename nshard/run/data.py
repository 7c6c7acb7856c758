"""Documents, target weights, replay and retention sets, the prepared-input identity and the batch schedule.

Knows nothing of distribution: dealing a global batch to ranks is a pure function of the batch,
the document lengths and the world size.
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from dataclasses import dataclass
from pathlib import Path

from nshard import tasks
from nshard.files import write_json_atomic, write_jsonl_atomic
from nshard.run.cohort import AcceptedStudy, CohortError, read_accepted
from nshard.run.plan import Plan

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A data file or document that cannot be trained on; the message names the place and the fix."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    kind: str
    """'task', 'replay', 'chat' (own training rows) or 'heldout' (own held-out rows, never trained)."""
    family: str
    """Task family, 'replay' or 'chat'."""
    messages: tuple[dict, ...]
    response_weight: float
    expected: str | None = None
    """A held-out row's expected answer (its "expected" field): scored by greedy exact match."""


@dataclass(frozen=True)
class Prepared:
    """One tokenized document: weights[t] weighs the loss of predicting input_ids[t] from input_ids[:t]."""

    doc_id: str
    input_ids: list[int]
    weights: list[float]
    prompt_ids: list[int] | None = None
    """A held-out row with an expected answer: the model input its greedy answer continues (the turns before its
    last assistant turn, then the assistant header)."""
    expected: str | None = None

    @property
    def target_weight(self) -> float:
        # weights[0] is never a target (nothing predicts the first token), exactly as in the loss.
        return math.fsum(self.weights[1:])


# ---------------------------------------------------------------- documents


def task_documents(cases: list, weight: float) -> list[Document]:
    docs = []
    for case in cases:
        family = tasks.FAMILIES[case.family]
        messages = ({"role": "user", "content": family.prompt(case)},
                    {"role": "assistant", "content": family.answer(case)})
        docs.append(Document(case.case_id, "task", case.family, messages, weight))
    return docs


def read_replay_file(path: str | Path, default_weight: float) -> list[Document]:
    """Read a JSONL file of {"messages": [{"role", "content"}...], "weight"?: float} lines."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.replay_file {path} does not exist: give a JSONL file of chat messages")
    docs = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: each line must be a JSON object with a 'messages' list")
        messages = validate_messages(record.get("messages"), where)
        weight = record.get("weight", default_weight)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(f"{where}: 'weight' must be a positive number, got {weight!r}")
        doc_id = record.get("id", f"replay-{path.stem}-{lineno:06d}")
        docs.append(Document(str(doc_id), "replay", "replay", messages, float(weight)))
    if len({d.doc_id for d in docs}) != len(docs):
        raise DataError(f"{path}: two lines share an 'id'; document ids must be unique")
    return docs


def validate_messages(messages, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise DataError(f"{where}: messages[{i}] must have exactly the keys 'role' and 'content'")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}].role={message['role']!r}; use one of {ROLES}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: messages[{i}].content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so it has no response tokens "
                        "to train on; add an assistant message or drop the line")
    return tuple(dict(m) for m in messages)


def stable_order(items: list[str], *salt) -> list[str]:
    """Order items by SHA-256 of (salt, item): the same on every machine and Python version."""
    def key(item):
        return hashlib.sha256(json.dumps([*salt, item]).encode()).hexdigest()
    return sorted(items, key=key)


def retention_ids(replay: list[Document], count: int, seed: int) -> list[str]:
    return stable_order([d.doc_id for d in replay], "retention", seed)[:count]


# ---------------------------------------------------------------- tokenization


def tokenize(tokenizer, doc: Document, max_length: int) -> Prepared:
    """Render with the chat template; weight = response_weight on every assistant token and its end-of-turn token."""
    ids = _template_ids(tokenizer, doc.messages, add_generation_prompt=False)
    weights = [0.0] * len(ids)
    for i, message in enumerate(doc.messages):
        if message["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, doc.messages[:i], add_generation_prompt=True))
        prefix = _template_ids(tokenizer, doc.messages[: i + 1], add_generation_prompt=False)
        if ids[: len(prefix)] != prefix:
            raise DataError(f"{doc.doc_id}: the chat template does not render turns as a prefix of the "
                            "whole conversation, so response tokens cannot be located")
        end = _end_of_turn(tokenizer, prefix, start)
        for t in range(start, end):
            weights[t] = doc.response_weight
    if len(ids) > max_length:
        raise DataError(f"{doc.doc_id}: {len(ids)} tokens exceed model.max_length={max_length}; "
                        "raise model.max_length or shorten the document")
    if not any(weights):
        raise DataError(f"{doc.doc_id}: no response tokens after tokenization")
    return Prepared(doc.doc_id, ids, weights)


def _template_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), tokenize=True,
                                        add_generation_prompt=add_generation_prompt, return_dict=True)
    return list(out["input_ids"])


_END_OF_TURN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def end_of_turn_id(tokenizer) -> int | None:
    """The token that closes a chat turn: ChatML's <|im_end|> where the vocabulary has it, else EOS. Looked up once
    per tokenizer: `get_vocab()` builds the whole vocabulary as a dict on every call (about 27 ms for SmolLM2's
    49,152 tokens on one core), and a run tokenizes every document at start-up, so asking it per document cost each
    rank of the main job (240 documents) about 6.5 s before its first update (launch/recipe/main-job-startup.md)."""
    if tokenizer not in _END_OF_TURN:
        _END_OF_TURN[tokenizer] = (tokenizer.convert_tokens_to_ids("<|im_end|>")
                                   if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id)
    return _END_OF_TURN[tokenizer]


def _end_of_turn(tokenizer, prefix: list[int], start: int) -> int:
    """Index just past the assistant turn's end-of-turn token (template text after it, e.g. a newline, is not trained)."""
    eot = end_of_turn_id(tokenizer)
    for t in range(len(prefix) - 1, start - 1, -1):
        if prefix[t] == eot:
            return t + 1
    return len(prefix)


# ---------------------------------------------------------------- schedule


def batch_schedule(n_docs: int, updates: int, global_batch: int, seed: int) -> list[list[int]]:
    """Each update's global batch of document indices: epochs of seed-ordered permutations, cut in order.

    A batch that spans two epochs never holds a document twice: a repeat is deferred to the next batch.
    """
    stream: list[int] = []
    epoch = 0
    batches: list[list[int]] = []
    deferred: list[int] = []
    while len(batches) < updates:
        while len(stream) < global_batch * 2:
            stream.extend(int(i) for i in stable_order([str(i) for i in range(n_docs)], "epoch", seed, epoch))
            epoch += 1
        batch: list[int] = []
        pending, deferred = deferred + stream, []
        taken = 0
        for doc in pending:
            if len(batch) == global_batch:
                break
            taken += 1
            (deferred if doc in batch else batch).append(doc)
        stream = pending[taken:]
        batches.append(batch)
    return batches


def deal(batch: list[int], lengths: list[int], world: int, microbatch: int,
         reverse_ranks: bool = False) -> list[list[list[int]]]:
    """Sort a global batch by length, cut it into the microbatches one rank would run, and deal those whole to the
    ranks, the order snaking back each round (ranks 0 1 1 0 0 1 ...: the longest ones spread over the ranks).

    Returns rank -> microbatches -> document indices. Each microbatch is the one-rank arm's, the same documents
    padded to the same length on any world size, so a bf16 forward and backward of it is the same tensor
    computation there; only the fp32 sum of the microbatches' gradients changes order. (Dealing documents
    round-robin made every two-rank microbatch a new bf16 computation: noise the paired screen then counted.)
    With fewer microbatches than ranks the documents themselves are dealt round-robin, one microbatch a rank, so
    that no rank idles. Every rank gets the same number of microbatches (gradient accumulation steps must
    agree); a rank with fewer gets an empty one last, which the trainer runs with zero weight.
    """
    if len(batch) < world:
        raise DataError(f"a global batch of {len(batch)} documents cannot feed {world} ranks; "
                        "raise train.global_batch_docs to at least the world size")
    ordered = sorted(batch, key=lambda i: (-lengths[i], i))
    steps = accumulation_steps(len(batch), world, microbatch)
    micros = [ordered[s:s + microbatch] for s in range(0, len(ordered), microbatch)]
    if len(micros) < world:
        shares = [[ordered[r::world]] for r in range(world)]
    else:
        shares = [[] for _ in range(world)]
        for k in range(0, len(micros), world):
            ranks = range(world) if (k // world) % 2 == 0 else reversed(range(world))
            for r, micro in zip(ranks, micros[k:k + world]):
                shares[r].append(micro)
    if reverse_ranks:
        shares.reverse()
    return [share + [[] for _ in range(steps - len(share))] for share in shares]


def accumulation_steps(global_batch: int, world: int, microbatch: int) -> int:
    return math.ceil(math.ceil(global_batch / world) / microbatch)


# ---------------------------------------------------------------- prepared inputs


def prepared_identity(prepared: list[Prepared], schedule: list[list[int]], extra: dict) -> str:
    """SHA-256 over a canonical serialization: same plan, same identity, on any machine and world size."""
    h = hashlib.sha256()
    for p in prepared:
        answer = [] if p.prompt_ids is None else [p.prompt_ids, p.expected]  # task and replay identities unchanged
        h.update(json.dumps([p.doc_id, p.input_ids, [repr(float(w)) for w in p.weights], *answer],
                            separators=(",", ":")).encode())
        h.update(b"\n")
    h.update(json.dumps({"schedule": schedule, **extra}, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()



def write_prepared(out: Path, docs: list[Document], prepared: list[Prepared], schedule: list[list[int]],
                   extra: dict, identity: str) -> None:
    """Write prepared/ (documents.jsonl, schedule.json, sets.json, identity.json); identity.json last marks it complete."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(out / "documents.jsonl", ({"doc_id": d.doc_id, "kind": d.kind, "family": d.family,
                                                  "input_ids": p.input_ids, "weights": p.weights,
                                                  **({} if p.prompt_ids is None else
                                                     {"prompt_ids": p.prompt_ids, "expected": p.expected})}
                                                 for d, p in zip(docs, prepared)))
    write_json_atomic(out / "schedule.json", schedule)
    write_json_atomic(out / "sets.json", extra)
    write_json_atomic(out / "identity.json", {"prepared_identity": identity})


def prepare(plan: Plan, tokenizer, replay: list[Document], with_replay: bool = True, chat=None,
            retention_heldout: list[Document] = ()) -> tuple[list[Document], list[Prepared], list[list[int]], dict, str]:
    """Build the training documents, tokenize them and fix the schedule; returns (docs, prepared, schedule, sets, identity).
    A second cohort ([cohort]) adds its share of the first cohort's training cases to training, fresh cases of the
    first cohort's families to evaluation, and what it continues from to the sets (so the identity covers them).
    with_replay=False (a no-replay control; `replay` is then empty): none of the first cohort's cases either.
    chat: the plan's own conversations (nshard.run.chat.chat_data), given exactly when data.chat_train is set; its
    training rows join the task cases, its held-out rows follow every training document (the schedule never
    names them) and its files' hashes join the sets.
    retention_heldout: the held-out retention documents (nshard.run.replay.heldout_retention_documents), given exactly
    when data.heldout_retention_docs is set; they follow every training document too, never trained: a DataError
    names one whose id or prompt a training or replay document holds."""
    d = plan.data
    if bool(d.chat_train) != (chat is not None):
        raise DataError("data.chat_train and the chat data given to prepare disagree: pass "
                        "nshard.run.chat.chat_data(plan, tokenizer) exactly when the plan names own data")
    train_cases, eval_cases = tasks.split_cases(list(d.families), d.seed, d.eval_seed,
                                                d.train_cases_per_family, d.eval_cases_per_family)
    cohort_sets = {}
    if plan.cohort.enabled:
        replayed, cohort_eval, cohort_sets = first_cohort(plan, train_cases, eval_cases, with_replay)
        train_cases, eval_cases = train_cases + replayed, eval_cases + cohort_eval
    if len(retention_heldout) != d.heldout_retention_docs:
        raise DataError(f"data.heldout_retention_docs={d.heldout_retention_docs} but {len(retention_heldout)} held-out "
                        "retention documents were given: pass nshard.run.replay.heldout_retention_documents(plan, ...)")
    replay_weight = plan.cohort.first_cohort_response_weight or d.task_response_weight
    replayed_ids = set(cohort_sets.get("cohort", {}).get("first_cohort_replay_ids", []))
    tasks_docs = (task_documents([c for c in train_cases if c.case_id not in replayed_ids], d.task_response_weight)
                  + task_documents([c for c in train_cases if c.case_id in replayed_ids], replay_weight))
    docs = tasks_docs + (chat.train if chat else []) + replay
    check_never_trained(retention_heldout, docs)
    heldout = (chat.heldout if chat else []) + list(retention_heldout)
    if len({doc.doc_id for doc in docs + heldout}) != len(docs + heldout):
        raise DataError("two documents share an id (a replay or chat row id equal to a case id, or to another "
                        "row's?); make ids unique")
    prepared = [tokenize(tokenizer, doc, plan.model.max_length) for doc in tasks_docs]
    prepared += (chat.train_prepared if chat else []) + [tokenize(tokenizer, doc, plan.model.max_length) for doc in replay]
    if chat and plan.train.global_batch_docs > len(docs):  # without own data the plan checked the count
        raise DataError(f"train.global_batch_docs={plan.train.global_batch_docs} exceeds the {len(docs)} training "
                        "documents: lower it or add rows to data.chat_train")
    schedule = batch_schedule(len(docs), plan.train.updates, plan.train.global_batch_docs, d.seed)
    sets = {"eval_case_ids": [c.case_id for c in eval_cases],
            "retention_ids": retention_ids(replay, d.retention_docs, d.seed), **cohort_sets,
            **({"chat": chat.sets()} if chat else {}),
            **({"retention_heldout_ids": [doc.doc_id for doc in retention_heldout]} if retention_heldout else {})}
    prepared += (chat.heldout_prepared if chat else [])
    prepared += [tokenize(tokenizer, doc, plan.model.max_length) for doc in retention_heldout]
    docs = docs + heldout
    return docs, prepared, schedule, sets, prepared_identity(prepared, schedule, sets)


def check_never_trained(heldout: list[Document], trained: list[Document]) -> None:
    """No held-out retention document is trained: neither its id nor any of its prompts is in a training or replay
    document (a replay file or own data could hold the same conversation under another id)."""
    ids = {doc.doc_id for doc in trained}
    prompts = {m["content"].strip() for doc in trained for m in doc.messages if m["role"] == "user"}
    for doc in heldout:
        asked = [m["content"].strip() for m in doc.messages if m["role"] == "user"]
        if doc.doc_id in ids or prompts.intersection(asked):
            raise DataError(f"held-out retention document {doc.doc_id} ({asked[0][:60]!r}) is in the training set: a "
                            "training or replay document holds its id or prompt; lower data.heldout_retention_docs or "
                            "remove that conversation from data.replay_file / data.chat_train")


def first_cohort(plan: Plan, train_cases: list, eval_cases: list, with_replay: bool = True) -> tuple[list, list, dict]:
    """The first cohort's cases a second cohort replays and evaluates, and its sets entry. Every role's cases are
    checked apart (ids and prompts): no first-cohort evaluation case, nor a case this cohort evaluates, is trained."""
    accepted = read_accepted(plan.cohort.from_study)
    screened = accepted.screened_families(plan.cohort.screen_min_accuracy)
    replayed, kept_out, first_eval, fresh = first_cohort_cases(plan, accepted, screened)
    if not with_replay:
        replayed, kept_out = [], replayed + kept_out
    try:
        tasks.check_disjoint_roles({"training": train_cases + replayed, "evaluation": eval_cases + fresh,
                                    "first-cohort training not replayed": kept_out,
                                    "first-cohort evaluation": first_eval})
    except ValueError as exc:
        raise DataError(f"[cohort]: {exc}") from None
    sets = {"cohort": {"commitment_sha256": accepted.record_sha256, "candidate": accepted.candidate,
                       "start": plan.cohort.start, "dense_warmup": plan.cohort.dense_warmup,
                       "first_cohort_families": list(accepted.first_plan.data.families),
                       "first_cohort_screen_families": screened,
                       "screen_min_accuracy": plan.cohort.screen_min_accuracy,
                       "first_cohort_replay_ids": [c.case_id for c in replayed],
                       "first_cohort_replay_counts": {f: sum(c.family == f for c in replayed)
                                                      for f in accepted.first_plan.data.families},
                       "first_cohort_response_weight": (plan.cohort.first_cohort_response_weight
                                                        or plan.data.task_response_weight),
                       "first_cohort_eval_case_ids": [c.case_id for c in fresh]}}
    return replayed, fresh, sets


def replayed_case_ids(plan: Plan, train: list, families, per_family: int, screened: list[str]) -> list[str]:
    """The first cohort's training cases a second cohort replays: cohort.replay_cases' count of each family (every
    screened family whole), or else a seed-ordered cohort.first_cohort_share of all of them."""
    wanted = plan.cohort.replay_cases
    if not wanted:
        count = round(plan.cohort.first_cohort_share * len(train))
        return stable_order([c.case_id for c in train], "first-cohort replay", plan.data.seed)[:count]
    for family, count in wanted.items():
        if family not in families:
            raise CohortError(f"cohort.replay_cases.{family}: {family!r} is not a first-cohort family; the first "
                              f"cohort taught {list(families)}")
        if count > per_family:
            raise CohortError(f"cohort.replay_cases.{family}={count} exceeds the first cohort's {per_family} training "
                              f"cases of that family; lower it to at most {per_family}")
    partial = [f for f in screened if wanted.get(f, 0) != per_family]
    if partial:
        raise CohortError(f"cohort.replay_cases.{partial[0]}={wanted.get(partial[0], 0)}: the first-cohort screen "
                          f"counts {partial[0]}, so replay all {per_family} of its training cases "
                          f"({partial[0]} = {per_family})")
    chosen = []
    for family in families:
        ids = [c.case_id for c in train if c.family == family]
        chosen += stable_order(ids, "first-cohort replay", plan.data.seed, family)[:wanted.get(family, 0)]
    return chosen


def first_cohort_cases(plan: Plan, accepted: AcceptedStudy, screened: list[str]) -> tuple[list, list, list, list]:
    """(replayed, not replayed, first evaluation, fresh evaluation of the `screened` first-cohort families) cases. The first cohort's cases are
    rebuilt from its plan and must be the ones its run recorded; the replayed share is a seed-ordered choice."""
    first = accepted.first_plan.data
    taught = sorted(set(plan.data.families) & set(first.families))
    if taught:
        raise CohortError(f"data.families names {taught}, which the first cohort ({accepted.study_dir}) taught "
                          f"already; a second cohort teaches new families, e.g. {list(tasks.SECOND_COHORT)}")
    train, evaluation = tasks.split_cases(first.families, first.seed, first.eval_seed, first.train_cases_per_family,
                                          first.eval_cases_per_family)
    if tuple(c.case_id for c in evaluation) != accepted.first_eval_case_ids:
        raise CohortError(f"cohort.from: the first cohort's plan ({accepted.run_dir / 'plan.toml'}) rebuilds other "
                          "evaluation cases than its prepared/sets.json records; the study's files disagree")
    chosen = set(replayed_case_ids(plan, train, first.families, first.train_cases_per_family, screened))
    fresh = [c for f in screened for c in
             tasks.make_cases(f, plan.data.eval_seed, 0, plan.cohort.first_cohort_eval_cases_per_family)]
    return ([c for c in train if c.case_id in chosen], [c for c in train if c.case_id not in chosen], evaluation,
            fresh)
