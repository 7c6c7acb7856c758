"""Scoring's decoder (nshard/study/evaluate.py greedy_batch, generate_answers) and its side-by-side processes, on the
tiny model in this process: no launch."""

import math

import pytest
import torch

from nshard import tasks
from nshard.run.device import Placement, load_for_inference
from nshard.run.models import load_tokenizer, resolve_model
from nshard.study.evaluate import (answer_target, generate_answers, greedy_batch, prompt_ids, scoring_batches,
                                   side_by_side, stop_ids)


@pytest.fixture(scope="module")
def tiny():
    ref = resolve_model("tiny")
    tokenizer = load_tokenizer(ref)
    cases = [tasks.family_module(f).generate(1011, i) for f in ("lookup", "sorting", "invoice") for i in range(3)]
    return load_for_inference(ref, Placement("cpu", "float32")), tokenizer, cases, [prompt_ids(tokenizer, c) for c in cases]


def hf_greedy(model, rows, max_new_tokens, stops, pad):
    """transformers' own greedy generate on the same left-padded batch, each answer cut before its first stop."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             num_beams=1, eos_token_id=stops, pad_token_id=pad)
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[:next((k for k, t in enumerate(row) if t in stops), len(row))])
    return answers


def test_greedy_batch_gives_transformers_greedy_answers_in_fp32(tiny):
    """Uncut, the decoder that drops finished rows answers as transformers' generate does (fp32, tiny model): the
    same argmax at every step, with the KV cache, positions and left padding handled alike. With a stop token the
    random model reaches early ("\\n"), rows end at different steps and leave the batch."""
    model, tokenizer, _, inputs = tiny
    pad = tokenizer.pad_token_id
    for stops in (stop_ids(tokenizer), [*stop_ids(tokenizer), tokenizer.convert_tokens_to_ids("Ċ")]):
        ours = greedy_batch(model, inputs, 10, stops, pad)
        assert [ids for ids, _ in ours] == hf_greedy(model, inputs, 10, stops, pad)
        assert not any(cut for _, cut in ours)


def test_a_row_that_cannot_be_right_is_cut_and_the_others_go_on(tiny):
    model, tokenizer, _, inputs = tiny
    stops, pad = stop_ids(tokenizer), tokenizer.pad_token_id
    full = greedy_batch(model, inputs, 8, stops, pad)
    # Rows 0 and 4 are cut after 2 and 5 tokens; the others run to max_new_tokens as before.
    limit = {0: 2, 4: 5}
    cut = greedy_batch(model, inputs, 8, stops, pad, lambda row, ids: len(ids) < limit.get(row, 99))
    for row, ((ids, was_cut), (full_ids, _)) in enumerate(zip(cut, full)):
        assert was_cut == (row in limit)
        assert ids == full_ids[:limit.get(row, 8)]


def test_generate_answers_cuts_by_the_expected_answer_and_never_a_right_one(tiny):
    """With targets, an answer ends at its first token after which no continuation can match (could_still_score);
    the tiny model's newlines never do (leading whitespace is forgiven), and a batch subset answers only its rows."""
    model, tokenizer, cases, inputs = tiny
    targets = [answer_target(c.family, tasks.answer(c)) for c in cases]
    every = generate_answers(model, tokenizer, inputs, 6, 4, targets=targets)
    assert sorted(every) == list(range(len(inputs)))
    for (ids, cut), case in zip((every[i] for i in range(len(inputs))), cases):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert cut == (not tasks.could_still_score(case, text))
        assert not (cut and tasks.score(case, text))
    some = generate_answers(model, tokenizer, inputs, 6, 4, batches=[1], targets=targets)
    assert sorted(some) == sorted(scoring_batches(inputs, 4)[1]) and all(some[i] == every[i] for i in some)


def test_an_answer_ends_at_the_token_that_makes_it_wrong(tiny):
    """The random tiny model only writes newlines, which any answer may start with; pushed to write "7" at every
    step it answers "7", "77", ...: a row whose answer is "77" is right until its third token, which it ends on
    (cut), a row whose answer is "12" ends on its first, a row whose answer is "777777" is never cut, and an own
    row's " 77 " (whitespace forgiven, no period) ends on its third."""
    model, tokenizer, _, inputs = tiny
    seven = tokenizer.convert_tokens_to_ids("7")
    push = model.lm_head.register_forward_hook(lambda module, args, out: out.index_add(
        -1, torch.tensor([seven]), torch.full((*out.shape[:-1], 1), 1e4, dtype=out.dtype)))
    try:
        targets = [("77", True), ("12", True), ("777777", True), answer_target("chat", " 77 ")] * 3
        got = generate_answers(model, tokenizer, inputs[:12], 6, 4, targets=targets[:len(inputs)])
    finally:
        push.remove()
    for k in range(len(inputs)):
        ids, cut = got[k]
        assert set(ids) == {seven}
        assert (len(ids), cut) == [(3, True), (1, True), (6, False), (3, True)][k % 4], (k, ids, cut)


def test_side_by_side_returns_results_in_job_order_and_raises_the_first_error():
    jobs = [(n,) for n in range(8)]
    assert side_by_side(math.factorial, jobs, 2, 1) == [math.factorial(n) for n in range(8)]
    assert side_by_side(math.factorial, jobs, 1, None) == [math.factorial(n) for n in range(8)]
    with pytest.raises(ValueError, match="not defined for negative values"):
        side_by_side(math.factorial, [(3,), (-1,), (4,)], 2, 1)


def test_scoring_and_regeneration_shared_between_two_processes_give_the_bits_of_one(tiny):
    """The study's side-by-side path on the tiny model in bf16: each of two spawned one-thread processes answers
    every other batch (score_share), together exactly what one process at one thread answers; regeneration shared
    the same way (regenerate_share) passes on those answers and names the case whose stored answer was changed."""
    from nshard.study.evaluate import score_share
    from nshard.study.validate import ValidationError, regenerate_share, torch_threads

    _, _, cases, inputs = tiny
    model_dir, placement = resolve_model("tiny").path, Placement("cpu", "bfloat16")
    targets = [answer_target(c.family, tasks.answer(c)) for c in cases]
    batches = len(scoring_batches(inputs, 2))
    shares = side_by_side(score_share, [(model_dir, placement, inputs, targets, 6, 2, list(range(k, batches, 2)), {})
                                        for k in range(2)], 2, 1)
    with torch_threads(1):
        whole = score_share(model_dir, placement, inputs, targets, 6, 2, list(range(batches)), {})
    assert [s["threads"] for s in shares] == [1, 1] and {**shares[0]["answers"], **shares[1]["answers"]} == whole["answers"]
    stored = [whole["answers"][i] for i in range(len(inputs))]
    ids = [c.case_id for c in cases]

    def regenerate(stored):
        return side_by_side(regenerate_share, [("tiny", model_dir, placement, 1, inputs, targets, stored, ids, 6, 2,
                                                list(range(k, batches, 2)), []) for k in range(2)], 2, 1)

    assert sum(r["batches"] for r in regenerate(stored)) == batches
    stored[3] = (stored[3][0][:-1] + [5], stored[3][1])
    with pytest.raises(ValidationError, match=f"validation failed: tiny: {ids[3]}: regenerated answer differs"):
        regenerate(stored)
