"""Growth (nshard/grow.py): a trained tiny Llama export grown into a Mixtral (the first design) or a Qwen2-MoE (a
shared expert and a router the task trains), each with logits equal to the dense model's, loaded by plain
transformers in a process that never imports nshard, sealed with its own provenance."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nshard.evidence.export import verify_manifest
from nshard.files import file_sha256
from runs import REPO, cached_run, tiny_config


def grow(source, out, *args, check=True):
    proc = subprocess.run([sys.executable, "-m", "nshard.grow", "--from", str(source), "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def dense(runs_root):
    return cached_run(runs_root, "ds-dense", tiny_config())


@pytest.fixture(scope="module")
def grown(dense, tmp_path_factory):
    out = tmp_path_factory.mktemp("grow") / "grown"
    grow(dense, out, "--experts", "4", "--top_k", "2", "--seed", "3")
    return out


PLAIN_PAIR = """
import sys, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([[1, 5, 9, 42, 7, 300, 11, 2], [3, 4, 5, 6, 7, 8, 9, 10]])
out = {}
for key, path in (("dense", sys.argv[1]), ("grown", sys.argv[2])):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out[key] = model(input_ids=ids).logits
    out[key + "_class"] = type(model).__name__
    if key == "grown":
        experts = model.model.layers[0].mlp.experts
        out["fused"] = (tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape))
        with torch.no_grad():  # routing really spreads the tokens: not all on the same top-k experts
            logits = model(input_ids=ids, output_router_logits=True).router_logits
        out["routed"] = sorted({tuple(sorted(row)) for layer in logits for row in layer.topk(2).indices.tolist()})
assert not [m for m in sys.modules if m == "nshard" or m.startswith("nshard.")], "nshard was imported"
torch.save(out, sys.argv[3])
"""


def plain_pair(dense_model, grown_dir, tmp_path) -> dict:
    """Both models' logits, computed by plain transformers in a process that never imports nshard."""
    out = tmp_path / "logits.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", PLAIN_PAIR, str(dense_model), str(grown_dir), str(out)], cwd=tmp_path,
                   check=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)
    return torch.load(out)


def test_grown_logits_equal_the_dense_model_in_plain_transformers(dense, grown, tmp_path):
    got = plain_pair(dense / "model", grown, tmp_path)
    assert (got["dense_class"], got["grown_class"]) == ("LlamaForCausalLM", "MixtralForCausalLM")
    assert got["fused"] == ((4, 256, 64), (4, 64, 128))
    assert len(got["routed"]) > 1, got["routed"]
    # Identical experts, top-k weights renormalized to 1: equal up to fp32 rounding of w1*f + w2*f.
    torch.testing.assert_close(got["grown"], got["dense"], rtol=0, atol=1e-5)
    assert not torch.equal(got["grown"], torch.zeros_like(got["grown"]))


def test_grown_export_has_its_own_manifest_naming_the_source_and_its_record(dense, grown):
    manifest = verify_manifest(grown)
    source = manifest["grown"]["source"]
    assert source["kind"] == "run" and source["run_dir"] == str(dense.resolve())
    assert source["run_json_sha256"] == file_sha256(dense / "run.json")
    assert source["manifest_sha256"] == file_sha256(dense / "model" / "manifest.json")
    assert source["parameter_root"] == json.loads((dense / "run.json").read_text())["parameter_root"]
    assert manifest["parameter_root"] != source["parameter_root"]
    assert manifest["grown"]["growth"] == {"experts": 4, "top_k": 2, "seed": 3, "router_std": 0.02, "aux_coef": 0.01}
    assert json.loads((grown / "nshard-grown.json").read_text()) == manifest["grown"]
    # Tiny Llama: 2 layers of 3 x (128 x 64) MLP weights, 4 copies each; a token passes through 2 of the 4.
    mlp = 2 * 3 * 128 * 64
    assert manifest["grown"]["expert_parameters"] == 4 * mlp
    from transformers import AutoModelForCausalLM

    dense_count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(dense / "model").parameters())
    routers = 2 * 4 * 64
    assert manifest["grown"]["parameters"] == dense_count + 3 * mlp + routers
    assert manifest["grown"]["router_parameters"] == routers
    assert manifest["grown"]["active_parameters_per_token"] == dense_count + mlp + routers  # every token routed


def test_the_router_seed_is_the_only_difference_between_two_growths(dense, grown, tmp_path):
    from safetensors.torch import load_file

    again = tmp_path / "again"
    grow(dense, again, "--experts", "4", "--top_k", "2", "--seed", "4")
    a, b = load_file(str(grown / "model.safetensors")), load_file(str(again / "model.safetensors"))
    differ = sorted(name for name in a if not torch.equal(a[name], b[name]))
    # transformers writes Mixtral's original checkpoint layout (block_sparse_moe.experts.E.w1/w2/w3), fusing on load.
    assert differ == ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.gate.weight"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in a


@pytest.mark.parametrize("args, names", [(["--experts", "4", "--top_k", "5"], "--top_k 5"),
                                         (["--experts", "1"], "--experts 1"),
                                         (["--router_std", "0"], "--router_std 0"),
                                         (["--freeze", "shared"], "--freeze shared"),
                                         (["--expert_size", "32"], "--expert_size 32"),
                                         (["--architecture", "qwen2_moe", "--expert_size", "-1"], "--expert_size -1")])
def test_bad_settings_are_refused_by_name(dense, tmp_path, args, names):
    proc = grow(dense, tmp_path / "bad", *args, check=False)
    assert proc.returncode == 2 and names in proc.stderr, proc.stderr
    assert not (tmp_path / "bad").exists()


def test_a_source_that_is_no_run_nor_study_is_refused(tmp_path):
    proc = grow(tmp_path, tmp_path / "out", check=False)
    assert proc.returncode == 2 and "neither a study directory" in proc.stderr, proc.stderr


def test_a_bf16_export_grows_in_bf16_so_a_bf16_engine_holds_the_grown_root(tmp_path):
    """A main job that computes in bf16 exports bf16 weights. Grown into fp32, its router would be rounded when the
    grown arm's bf16 engine takes the model, and the arm's start check (the loaded root against the grown export's)
    would fail, as the first embedded growth study did (docs/growth.md). Grown in the source's dtype, the model
    the trainer loads (fp32, then cast to bf16 as DeepSpeed's bf16 engine casts it) hashes to the grown root."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nshard.grow import Growth, upcycle
    from nshard.run.models import ModelRef, load_model, resolve_model
    from nshard.run.receipts import parameter_root

    tiny = resolve_model("tiny")
    source = tmp_path / "bf16-export"
    AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.bfloat16).save_pretrained(source)
    AutoTokenizer.from_pretrained(tiny.path).save_pretrained(source)
    grown, tokenizer = upcycle(source, Growth(experts=4, top_k=2, seed=3))
    assert {p.dtype for p in grown.parameters()} == {torch.bfloat16}
    assert grown.config.tie_word_embeddings and grown.lm_head.weight is grown.model.embed_tokens.weight
    grown.save_pretrained(tmp_path / "grown")
    loaded = load_model(ModelRef(str(tmp_path / "grown"), str(tmp_path / "grown"), None, "local")).to(torch.bfloat16)
    assert parameter_root(loaded.named_parameters()) == parameter_root(grown.named_parameters())
    # The router is the same draw as an fp32 growth's, rounded once.
    fp32, _ = upcycle(tiny.path, Growth(experts=4, top_k=2, seed=3))
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(dict(grown.named_parameters())[router], dict(fp32.named_parameters())[router].bfloat16())


@pytest.fixture(scope="module")
def grown_qwen(dense, tmp_path_factory):
    out = tmp_path_factory.mktemp("grow-qwen") / "grown"
    grow(dense, out, "--architecture", "qwen2_moe", "--experts", "4", "--top_k", "1", "--expert_size", "32",
         "--freeze", "shared", "--seed", "3")
    return out


def test_a_qwen2_moe_growth_loads_in_plain_transformers_and_computes_the_dense_model(dense, grown_qwen, tmp_path):
    """The shared-expert design: the export is transformers' own Qwen2MoeForCausalLM (fused routed experts of the
    declared size), it loads without nshard, and before training its logits are the dense model's."""
    got = plain_pair(dense / "model", grown_qwen, tmp_path)
    assert (got["dense_class"], got["grown_class"]) == ("LlamaForCausalLM", "Qwen2MoeForCausalLM")
    assert got["fused"] == ((4, 64, 64), (4, 64, 32))
    print(f"qwen2_moe export, plain transformers: largest logit difference "
          f"{(got['grown'] - got['dense']).abs().max().item():.3g}")
    torch.testing.assert_close(got["grown"], got["dense"], rtol=0, atol=1e-5)


def test_a_qwen2_moe_manifest_records_its_design_and_prices_the_frozen_shared_expert(dense, grown_qwen):
    """The record names the design and its settings; the budget counts every parameter a token passes through
    (embeddings, attention, the router, the shared expert and its gate, one routed expert of four) and the frozen
    shared expert at its forward and the backward through it (nshard/run/budget.py HOW)."""
    from transformers import AutoModelForCausalLM

    from nshard.run import budget

    manifest = verify_manifest(grown_qwen)["grown"]
    assert manifest["architecture"] == "Qwen2MoeForCausalLM" and manifest["method"].startswith("shared-expert")
    assert manifest["growth"] == {"experts": 4, "top_k": 1, "seed": 3, "router_std": 0.02, "aux_coef": 0.01,
                                  "architecture": "qwen2_moe", "expert_size": 32, "freeze": "shared"}
    dense_count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(dense / "model").parameters())
    mlp, routed, router, gate = 3 * 128 * 64, 3 * 32 * 64, 4 * 64, 64  # per layer, 2 layers
    assert manifest["parameters"] == dense_count + 2 * (4 * routed + router + gate)
    assert manifest["active_parameters_per_token"] == dense_count + 2 * (routed + router + gate)
    assert manifest["frozen_active_parameters_per_token"] == 2 * (mlp + gate)
    assert budget.declared_freeze(grown_qwen) == "shared"
    assert budget.model_cost(grown_qwen) == (manifest["active_parameters_per_token"],
                                             manifest["frozen_active_parameters_per_token"])
    assert budget.model_cost(dense / "model") == (dense_count, 0)
