"""model/ carries a manifest that binds every file and the run; it loads with plain transformers, files 0644."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nshard.evidence.export import ManifestError, verify_manifest
from nshard.run.receipts import parameter_root
from runs import cached_run, tiny_config


@pytest.fixture(scope="module")
def run(runs_root):
    return cached_run(runs_root, "ds-dense", tiny_config())


def test_manifest_binds_every_file_and_the_run(run):
    manifest = verify_manifest(run / "model")
    run_json = json.loads((run / "run.json").read_text())
    on_disk = {p.relative_to(run / "model").as_posix() for p in (run / "model").rglob("*")}
    assert set(manifest["entries"]) == on_disk - {"manifest.json"}
    files = {rel for rel, entry in manifest["entries"].items() if entry["kind"] == "file"}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    for key in ("parameter_root", "plan_sha256", "ds_config_sha256", "prepared_identity"):
        assert manifest[key] == run_json[key], key
    assert manifest["parameter_root"] == parameter_root(load_file(str(run / "model" / "model.safetensors")).items())
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["source"]["commit"])
    assert isinstance(manifest["source"]["dirty"], bool)


def test_export_is_readable_by_others(run):
    assert stat.S_IMODE((run / "model").stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (run / "model").iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("damage", ["flip", "missing", "extra"])
def test_manifest_names_a_changed_missing_or_extra_file(run, tmp_path, damage):
    model = tmp_path / "model"
    shutil.copytree(run / "model", model)
    target = model / "config.json"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "missing":
        target.unlink()
    else:
        target = model / "stray.bin"
        target.write_bytes(b"x")
    with pytest.raises(ManifestError, match=re.escape(target.name)):
        verify_manifest(model)


PLAIN_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[1, 5, 9, 42, 7, 300, 11, 2]])).logits
assert not [m for m in sys.modules if m == "nshard" or m.startswith("nshard.")], "nshard was imported"
torch.save(logits, sys.argv[2])
"""


def test_export_loads_with_plain_transformers_and_gives_the_trained_logits(run, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "logits.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(run / "model"), str(out)], cwd=tmp_path, check=True,
                   env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)
    # The reference: a model built from the config alone, given the trained tensors, whose parameter root
    # is the one every rank agreed on at the end of training.
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run / "model"))
    missing, unexpected = trained.load_state_dict(load_file(str(run / "model" / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    trained.tie_weights()
    assert parameter_root(trained.named_parameters()) == json.loads((run / "run.json").read_text())["parameter_root"]
    with torch.no_grad():
        expected = trained.eval()(input_ids=torch.tensor([[1, 5, 9, 42, 7, 300, 11, 2]])).logits
    torch.testing.assert_close(torch.load(out), expected, rtol=0, atol=0)
