"""Your own conversations: a plan's chat training split and its declared held-out split, read with Hugging Face
`datasets` (JSONL, parquet or a save_to_disk directory), checked row by row, tokenized once per file and tokenizer.

Both caches live under nshard.files.cache_root()/chat/: the checked rows of a file (keyed by its bytes), and their
tokens (keyed by the file's bytes, the tokenizer's own files and the default response weight).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from nshard.files import cache_root, file_sha256, write_jsonl_atomic
from nshard.run.data import DataError, Document, Prepared, tokenize, validate_messages
from nshard.run.plan import Plan

ANSWER_FIELD = "expected"
"""A held-out row's optional expected answer: the greedy answer to the turns before its last assistant turn must
equal it (both stripped of surrounding whitespace)."""
CACHE_VERSION = 1
"""Bump when rows are checked or tokenized differently, so cached copies are rebuilt."""
SPLITS = ("train", "heldout")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class ChatData:
    """Both splits, tokenized: training rows (kind 'chat') and held-out rows (kind 'heldout')."""

    train: list[Document]
    train_prepared: list[Prepared]
    heldout: list[Document]
    heldout_prepared: list[Prepared]
    files: dict = field(default_factory=dict)
    """split -> {"sha256": the data's bytes, "rows": count}: the prepared identity covers them."""

    def sets(self) -> dict:
        return {"files": self.files, "heldout_ids": [d.doc_id for d in self.heldout], "answer_field": ANSWER_FIELD,
                "exact_match_ids": [d.doc_id for d in self.heldout if d.expected is not None]}


def split_path(plan: Plan, split: str) -> Path:
    return Path(plan.data.chat_train if split == "train" else plan.data.chat_heldout)


def data_sha256(path: Path) -> str:
    """A file's SHA-256; a save_to_disk directory's: over each file's relative path and SHA-256, sorted."""
    if path.is_file():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def check_chat_source(plan: Plan) -> None:
    """Before any model exists: both splits load and every row holds (one DataError naming file, line and field)."""
    if plan.data.chat_train:
        read_splits(plan)


def read_splits(plan: Plan) -> dict[str, tuple[str, list[Document]]]:
    """split -> (data sha256, documents); a held-out conversation that is also a training one is an error."""
    splits = {s: read_rows(split_path(plan, s), s, plan.data.chat_response_weight) for s in SPLITS}
    seen = {json.dumps(d.messages, sort_keys=True): d.doc_id for d in splits["train"][1]}
    for doc in splits["heldout"][1]:
        twin = seen.get(json.dumps(doc.messages, sort_keys=True))
        if twin is not None:
            raise DataError(f"data.chat_heldout {plan.data.chat_heldout}: row {doc.doc_id} is the training row {twin} "
                            "of data.chat_train; a held-out row must not be trained on: drop it from one split")
    return splits


def read_rows(path: Path, split: str, default_weight: float) -> tuple[str, list[Document]]:
    """The checked rows of one split, from the rows cache when this file's bytes were checked before."""
    key = f"data.chat_{split}"
    if not path.exists():
        raise DataError(f"{key} {path} does not exist: give a .jsonl or .parquet file of {{\"messages\": [...]}} rows "
                        "or a directory written by datasets' save_to_disk")
    sha = data_sha256(path)
    cached = cache_root() / "chat" / f"rows-v{CACHE_VERSION}-{sha[:24]}-{split}.jsonl"
    if cached.is_file():
        rows = [json.loads(line) for line in cached.read_text().splitlines() if line.strip()]
    else:
        rows = [_check_row(row, where, split, n) for n, (row, where) in enumerate(_load(path, key), start=1)]
        if not rows:
            raise DataError(f"{key} {path} holds no rows; give at least one conversation")
        if len({r["id"] for r in rows}) != len(rows):
            raise DataError(f"{path}: two rows share an 'id'; row ids must be unique")
        write_jsonl_atomic(cached, rows)
    kind = "chat" if split == "train" else "heldout"
    docs = [Document(r["id"], kind, "chat", tuple(r["messages"]), r["weight"] or default_weight,
                     r[ANSWER_FIELD] if split == "heldout" else None) for r in rows]
    return sha, docs


def _load(path: Path, key: str):
    """(row, where) pairs through `datasets`: where is FILE:LINE for JSONL (blank lines skipped, as arrow does),
    FILE row N otherwise."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="nshard-datasets-") as tmp:  # no arrow cache left behind
        if path.is_dir():
            try:
                table = datasets.load_from_disk(str(path))
            except (FileNotFoundError, ValueError) as exc:
                raise DataError(f"{key} {path} is not a directory written by datasets' save_to_disk ({exc}); give "
                                "such a directory or a .jsonl/.parquet file") from None
            if isinstance(table, datasets.DatasetDict):
                raise DataError(f"{key} {path} holds the splits {sorted(table)}: name one split's directory, e.g. "
                                f"{path / sorted(table)[0]}")
        elif path.suffix in FORMATS:
            try:
                table = datasets.load_dataset(FORMATS[path.suffix], data_files=str(path), split="train", cache_dir=tmp)
            except Exception as exc:  # noqa: BLE001 -- datasets wraps arrow's parse errors in its own
                raise DataError(_unreadable(path, key, exc)) from None
        else:
            raise DataError(f"{key} {path}: give a .jsonl, .json or .parquet file or a save_to_disk directory "
                            f"(its suffix {path.suffix!r} names no format)")
        if "messages" not in table.column_names:
            raise DataError(f"{key} {path} has no 'messages' column (it has {table.column_names}); each row needs "
                            "'messages': [{'role', 'content'}, ...]")
        rows = table.to_list()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        lines = [n for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
        if len(lines) == len(rows):
            return [(row, f"{path}:{n}") for row, n in zip(rows, lines)]
    return [(row, f"{path} row {n}") for n, row in enumerate(rows, start=1)]


def _unreadable(path: Path, key: str, exc: Exception) -> str:
    """datasets' error names no line; for JSONL the first line that is not one JSON object is found and named."""
    if path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except json.JSONDecodeError as bad:
                return f"{path}:{n}: not valid JSON ({bad.msg}); each line must be one JSON object"
            if not ok:
                return f"{path}:{n}: not a JSON object; each line must be {{\"messages\": [...]}}"
    why = " ".join(str(exc.__cause__ or exc).split())[-300:]
    return f"{key} {path}: datasets could not read it: {why}; fix the file (each row {{\"messages\": [...]}})"


def _check_row(row: dict, where: str, split: str, n: int) -> dict:
    """One row as the rows cache keeps it; arrow's missing struct members (None) count as absent."""
    messages = row.get("messages")
    if isinstance(messages, list):
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
    messages = validate_messages(messages, where)
    weight = row.get("weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0):
        raise DataError(f"{where}: field 'weight' must be a positive number, got {weight!r}")
    expected = row.get(ANSWER_FIELD)
    if expected is not None and (not isinstance(expected, str) or not expected.strip()):
        raise DataError(f"{where}: field '{ANSWER_FIELD}' must be a non-empty string, got {expected!r}")
    row_id = row.get("id")
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise DataError(f"{where}: field 'id' must be a string or an integer, got {row_id!r}")
    return {"id": f"chat-{split}-{n:06d}" if row_id is None else str(row_id), "messages": list(messages),
            "weight": None if weight is None else float(weight), ANSWER_FIELD: expected}


# ---------------------------------------------------------------- tokens


def tokenizer_sha256(tokenizer) -> str:
    """What decides the tokens: the tokenizer's class, its serialized model (vocabulary, merges, normalizer) and its
    chat template and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    h.update(body.encode())
    h.update(json.dumps([tokenizer.chat_template, tokenizer.special_tokens_map], sort_keys=True, default=str).encode())
    return h.hexdigest()


def chat_data(plan: Plan, tokenizer) -> ChatData | None:
    """Both splits of the plan's own data, tokenized (from the token cache when this file and tokenizer met before);
    None when the plan names none."""
    if not plan.data.chat_train:
        return None
    splits = read_splits(plan)
    tok_sha = tokenizer_sha256(tokenizer)
    out, files = {}, {}
    for split, (sha, docs) in splits.items():
        prepared = _tokens(docs, split, sha, tok_sha, plan.data.chat_response_weight, tokenizer)
        for doc, p in zip(docs, prepared):
            if len(p.input_ids) > plan.model.max_length:
                raise DataError(f"data.chat_{split} {split_path(plan, split)}: row {doc.doc_id} has {len(p.input_ids)} "
                                f"tokens, over model.max_length={plan.model.max_length}; raise it or shorten the row")
        out[split] = (docs, prepared)
        files[split] = {"sha256": sha, "rows": len(docs)}
    return ChatData(out["train"][0], out["train"][1], out["heldout"][0], out["heldout"][1], files)


def _tokens(docs: list[Document], split: str, data_sha: str, tok_sha: str, weight: float, tokenizer) -> list[Prepared]:
    key = hashlib.sha256(json.dumps([CACHE_VERSION, split, data_sha, tok_sha, repr(weight)]).encode()).hexdigest()
    path = cache_root() / "chat" / f"tokens-{key[:24]}.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [Prepared(r["doc_id"], r["input_ids"], r["weights"], r.get("prompt_ids"), r.get("expected"))
                for r in rows]
    prepared = [_tokenize_row(tokenizer, doc, split) for doc in docs]
    write_jsonl_atomic(path, ({"doc_id": p.doc_id, "input_ids": p.input_ids, "weights": p.weights,
                               **({} if p.prompt_ids is None else {"prompt_ids": p.prompt_ids, "expected": p.expected})}
                              for p in prepared))
    return prepared


def _tokenize_row(tokenizer, doc: Document, split: str) -> Prepared:
    """Assistant tokens weigh the row's weight (nshard.run.data.tokenize); a held-out row with an expected answer also
    gets its prompt: the turns before its last assistant turn, then the assistant header."""
    try:
        p = tokenize(tokenizer, doc, max_length=1 << 62)  # the plan's max_length is checked on the cached tokens
    except DataError as exc:
        raise DataError(f"data.chat_{split}: {exc}") from None
    if doc.expected is None:
        return p
    last = max(i for i, m in enumerate(doc.messages) if m["role"] == "assistant")
    out = tokenizer.apply_chat_template(list(doc.messages[:last]), tokenize=True, add_generation_prompt=True,
                                        return_dict=True)
    return Prepared(p.doc_id, p.input_ids, p.weights, list(out["input_ids"]), doc.expected)
