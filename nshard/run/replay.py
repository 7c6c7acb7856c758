"""Replay documents: general conversations that are not task cases.

From the plan's JSONL file when it names one; otherwise the seed model's own greedy answers to a
built-in set of general prompts, generated once per (model, prompts, length) and cached, so
replay pulls the fine-tune toward what the model already said.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nshard.run.data import DataError, Document, read_replay_file
from nshard.files import cache_root, write_jsonl_atomic
from nshard.run.plan import Plan

GENERAL_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a rainbow is in two sentences.",
    "Write a short, friendly greeting for a new colleague.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "How do plants make their food?",
    "Describe a cat to someone who has never seen one.",
    "What are the primary colors?",
    "Why do we need sleep?",
    "Give an example of a renewable energy source.",
    "What does a librarian do?",
    "Write one sentence about the ocean.",
    "How many days are there in a leap year?",
    "What is a good way to start learning to cook?",
    "Name three animals that live in the desert.",
    "What is the boiling point of water at sea level in Celsius?",
    "Explain what a computer program is to a child.",
    "What is the tallest mountain on Earth?",
    "Give me a simple recipe for a fruit salad.",
    "Why is exercise good for health?",
    "What is photosynthesis?",
    "Write a haiku about autumn.",
    "What are the four seasons?",
    "How does a bicycle work?",
    "What language is spoken in Brazil?",
    "Give two reasons to read books.",
    "What is the largest planet in our solar system?",
    "Describe the taste of a lemon.",
    "How can I save water at home?",
    "What is the purpose of a map?",
    "Tell me a fun fact about bees.",
)
MAX_NEW_TOKENS = 48


def check_replay_source(plan: Plan) -> None:
    """Before any model exists: the replay file parses and holds enough conversations, or the built-in prompts suffice."""
    d = plan.data
    if d.replay_docs and d.replay_file:
        replay_documents(plan, None, None)
    elif d.replay_docs > len(GENERAL_PROMPTS):
        raise DataError(f"data.replay_docs={d.replay_docs} exceeds the {len(GENERAL_PROMPTS)} built-in prompts; "
                        "give data.replay_file (JSONL of chat messages) for more")


def replay_documents(plan: Plan, model_ref, tokenizer) -> list[Document]:
    d = plan.data
    if d.replay_docs == 0:
        return []
    if d.replay_file:
        docs = read_replay_file(d.replay_file, d.replay_response_weight)
        if len(docs) < d.replay_docs:
            raise DataError(f"data.replay_file {d.replay_file} has {len(docs)} conversations but "
                            f"data.replay_docs={d.replay_docs}; lower replay_docs or add lines")
        return docs[: d.replay_docs]
    if d.replay_docs > len(GENERAL_PROMPTS):
        raise DataError(f"data.replay_docs={d.replay_docs} exceeds the {len(GENERAL_PROMPTS)} built-in prompts; "
                        "give data.replay_file (JSONL of chat messages) for more")
    path = _cache_path(model_ref, d.replay_docs)
    if not path.is_file():
        _generate(model_ref, tokenizer, GENERAL_PROMPTS[: d.replay_docs], path)
    return read_replay_file(path, d.replay_response_weight)


def _cache_path(model_ref, count: int) -> Path:
    root = cache_root()
    key = json.dumps([model_ref.sha256 or model_ref.spec, GENERAL_PROMPTS[:count], MAX_NEW_TOKENS])
    return root / "replay" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.jsonl"


def _generate(model_ref, tokenizer, prompts, path: Path, batch: int = 8) -> None:
    """Greedy answers of the seed model, written atomically as replay JSONL."""
    import torch

    from nshard.run.models import load_model

    model = load_model(model_ref).eval()
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    rows = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        for i, prompt in enumerate(chunk):
            answer = tokenizer.decode(out[i, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer or "."}]
            rows.append({"id": f"replay-builtin-{start + i:04d}", "messages": messages})
    tokenizer.padding_side = "right"
    write_jsonl_atomic(path, rows)
