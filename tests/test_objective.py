"""The study's objective test: batched, dealt, accumulated gradients equal a per-document reference.

Unequal lengths, unequal target weights, prompt and padding masking, a partial microbatch, an
empty (filler) microbatch and reversed rank assignment; the rank average is simulated exactly as
DeepSpeed and the nshard reducers do it (sum over ranks, divide by world size).
"""

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from nshard.run.data import Prepared, deal
from nshard.run.loss import pad_microbatch, rank_microbatches, weighted_nll_sum

PAD = 0


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def documents(n=7, seed=1):
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        length = rng.randint(5, 30)
        prompt = rng.randint(2, length - 2)
        ids = [rng.randint(1, 96) for _ in range(length)]
        w = rng.choice([0.5, 1.0, 2.0, 3.0])
        docs.append(Prepared(f"d{d}", ids, [0.0] * prompt + [w] * (length - prompt)))
    return docs


def reference_grads(model, docs):
    """One document at a time, no padding: sum of weight x NLL over documents / total weight."""
    model.zero_grad()
    total_weight = math.fsum(d.target_weight for d in docs)
    for d in docs:
        ids = torch.tensor([d.input_ids])
        logits = model(input_ids=ids).logits
        nll = -torch.log_softmax(logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        (nll * torch.tensor(d.weights[1:])).sum().div(total_weight).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def batched_grads(model, docs, world, microbatch, reverse):
    """Each rank's microbatches and loss scale exactly as the trainer takes them (rank_microbatches), its gradients
    accumulated on a replica, then the rank average DeepSpeed and the nshard reducers take (sum / world)."""
    batch = list(range(len(docs)))
    shares = deal(batch, [len(d.input_ids) for d in docs], world, microbatch, reverse)
    summed = None
    for rank in range(world):
        replica = copy.deepcopy(model)
        replica.zero_grad()
        micros = rank_microbatches(docs, batch, world, rank, microbatch, PAD, reverse_ranks=reverse)
        assert [[d.doc_id for d in mb.docs] for mb in micros if not mb.filler] == [
            [docs[i].doc_id for i in micro] for micro in shares[rank] if micro]
        for mb in micros:
            nll = weighted_nll_sum(replica(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits,
                                   mb.input_ids, mb.weights)
            (nll * mb.loss_scale).backward()
        grads = {n: p.grad.clone() for n, p in replica.named_parameters()}
        summed = grads if summed is None else {n: summed[n] + grads[n] for n in grads}
    return {n: g / world for n, g in summed.items()}, shares


def adamw_step(model, grads, lr=1e-2, eps=1e-4):
    """One AdamW step. Adam's first step is about lr * g / (|g| + eps): with eps at 1e-8 a gradient of
    1e-9 (fp32 summation noise around zero) flips to +-lr, so a larger eps keeps the check meaningful."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.0)
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("world,microbatch,reverse", [(1, 3, False), (2, 2, False), (2, 2, True), (3, 1, True)])
def test_batched_gradient_and_adamw_update_match_reference(world, microbatch, reverse):
    model, docs = tiny_model(), documents()
    ref = reference_grads(model, docs)
    got, shares = batched_grads(model, docs, world, microbatch, reverse)
    sizes = [[len(m) for m in share] for share in shares]
    if world == 2:
        # microbatches 0 1 to ranks 0 1, then 2 3 to ranks 1 0: rank 0 runs the longest and the partial one
        assert sizes[0 if not reverse else 1] == [2, 1] and sizes[1 if not reverse else 0] == [2, 2]
    if world == 3:
        assert [0 in s for s in sizes].count(True) == 2  # two ranks run a zero-weight filler microbatch
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)
    ref_params, got_params = adamw_step(model, ref), adamw_step(model, got)
    for name in ref_params:
        torch.testing.assert_close(got_params[name], ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_prompt_and_padding_tokens_carry_no_gradient():
    """d loss / d logits is exactly zero wherever the next token weighs 0 (prompt, padding, the last position),
    and weight x (softmax - one-hot) where it does not.

    Gradients are taken at the logits rather than by changing prompt tokens: a prompt token is also the
    context of every later token, so changing it legitimately moves the response-token loss.
    """
    model, docs = tiny_model(), documents(3)
    ids, mask, weights = pad_microbatch(docs, PAD)
    # The weight mask is exactly the documents' weights, padding zero.
    for row, d in enumerate(docs):
        assert weights[row, : len(d.weights)].tolist() == d.weights and not weights[row, len(d.weights) :].any()
    logits = model(input_ids=ids, attention_mask=mask).logits.detach().requires_grad_()
    weighted_nll_sum(logits, ids, weights).backward()
    next_weight = torch.cat([weights[:, 1:], torch.zeros(len(docs), 1)], dim=1)  # logits[:, t] predict ids[:, t + 1]
    unweighted = next_weight == 0
    prompt = torch.zeros_like(unweighted)  # positions whose next token is still in the prompt
    for row, d in enumerate(docs):
        prompt[row, : next(i for i, w in enumerate(d.weights) if w) - 1] = True
    # Not vacuous: every prompt position is unweighted, and some padding positions are too.
    assert prompt.any() and unweighted[prompt].all() and (unweighted & (mask == 0)).any() and (~unweighted).any()
    assert torch.equal(logits.grad[unweighted], torch.zeros_like(logits.grad[unweighted]))
    assert (logits.grad[~unweighted] != 0).any(dim=-1).all()
    targets = ids.roll(-1, dims=1)  # the wrapped last column has weight 0 and is not compared
    expected = next_weight[..., None] * (logits.detach().softmax(-1) - F.one_hot(targets, logits.size(-1)))
    torch.testing.assert_close(logits.grad[~unweighted], expected[~unweighted])
    # Padding: changing the pad id must not move the loss.
    base = weighted_nll_sum(logits.detach(), ids, weights)
    ids2, _, _ = pad_microbatch(docs, 5)
    moved = weighted_nll_sum(model(input_ids=ids2, attention_mask=mask).logits, ids2, weights)
    torch.testing.assert_close(base, moved)


def test_deal_is_length_sorted_and_covers_the_batch_once():
    lengths = [5, 9, 3, 9, 7, 1, 4]
    shares = deal(list(range(7)), lengths, 2, 2)
    flat = [i for share in shares for micro in share for i in micro]
    assert sorted(flat) == list(range(7))
    # Length order (ties by index) is 1 3 4 0 6 2 5: the one-rank microbatches [1, 3] [4, 0] [6, 2] [5], dealt whole
    # to ranks 0 1, then 1 0; every rank runs the same number of microbatches.
    assert shares == [[[1, 3], [5]], [[4, 0], [6, 2]]]
    assert deal(list(range(7)), lengths, 1, 2) == [[[1, 3], [4, 0], [6, 2], [5]]]
    assert deal(list(range(7)), lengths, 2, 4) == [[[1, 3, 4, 0]], [[6, 2, 5]]]
    # Fewer microbatches than ranks: the documents are dealt, one microbatch a rank, so no rank idles.
    assert deal(list(range(7)), lengths, 3, 4) == [[[1, 0, 5]], [[3, 6]], [[4, 2]]]
    assert deal(list(range(8)), [1] * 8, 2, 3) == [[[0, 1, 2], []], [[3, 4, 5], [6, 7]]]


def test_every_microbatch_of_a_two_rank_update_is_one_of_the_one_rank_arms():
    """With bf16 compute the same documents padded the same way are the same computation: each rank's microbatches
    (documents and padded input ids) are exactly microbatches of the one-rank arm, whatever the world size."""
    docs = documents()
    batch = list(range(len(docs)))
    one = {tuple(d.doc_id for d in mb.docs): mb.input_ids for mb in rank_microbatches(docs, batch, 1, 0, 2, PAD)}
    for world in (2, 3):
        for rank in range(world):
            for mb in rank_microbatches(docs, batch, world, rank, 2, PAD):
                if not mb.filler:
                    assert torch.equal(one[tuple(d.doc_id for d in mb.docs)], mb.input_ids)


def test_tokenize_weighs_each_response_through_its_end_of_turn_and_reads_the_vocabulary_once():
    """tokenize() weighs the assistant's tokens up to and including <|im_end|>, and nothing after it; the
    end-of-turn token is looked up in the vocabulary once per tokenizer, not once per document (get_vocab builds
    the whole vocabulary each call: about 6.5 s of every rank's start-up on SmolLM2's 240 documents)."""
    from nshard.run import data
    from nshard.run.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("tiny"))
    calls = []
    real = tokenizer.get_vocab
    tokenizer.get_vocab = lambda: calls.append(1) or real()
    docs = [data.Document(f"d{i}", "task", "lookup",
                          ({"role": "user", "content": f"what is {i}?"}, {"role": "assistant", "content": f"{i * 7}"}),
                          0.5 + i)
            for i in range(5)]
    out = [data.tokenize(tokenizer, doc, max_length=512) for doc in docs]
    assert len(calls) == 1
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert data.end_of_turn_id(tokenizer) == im_end != tokenizer.unk_token_id
    for doc, prepared in zip(docs, out):
        weighted = [t for t, w in zip(prepared.input_ids, prepared.weights) if w]
        last = max(i for i, w in enumerate(prepared.weights) if w)
        assert prepared.input_ids[last] == im_end and weighted[-1] == im_end
        assert set(w for w in prepared.weights if w) == {doc.response_weight}
        assert tokenizer.decode(weighted[:-1]) == doc.messages[1]["content"]
    assert len(calls) == 1
