"""The "nshard" section: defaults, and errors that name the key and the fix (no process group needed)."""

from __future__ import annotations

import pytest

from nshard.comm import ConfigError, build_reducer, validate_config

GOOD = {"reducer": "powersgd", "rank": 32, "dense_warmup_updates": 8, "min_compression_rate": 2,
        "error_feedback": "device", "warm_start": True, "seed": 0, "transport": "torch", "microbatch_sums": "exact",
        "parameter_sync": "dense", "delta_bits": 4, "delta_block": 256, "orthogonalization": "auto",
        "overlap_backward": False, "tf32": False}


def test_validate_returns_the_section_with_defaults_filled():
    assert validate_config(GOOD) == GOOD
    # The defaults are the study's recipe (rank 32, 8 dense warm-up updates): the bare section runs it.
    assert validate_config({"reducer": "powersgd"}) == GOOD
    assert validate_config(None)["reducer"] == "dense"


@pytest.mark.parametrize("key,value", [
    ("rank", 0), ("rank", 2.5), ("rank", True), ("rank", "4"),
    ("dense_warmup_updates", -1), ("dense_warmup_updates", 1.0),
    ("min_compression_rate", 0), ("min_compression_rate", -2), ("min_compression_rate", float("nan")),
    ("min_compression_rate", "2"),
    ("error_feedback", "cpu"), ("transport", "nccl"), ("reducer", "topk"), ("reducer", None),
    ("warm_start", "true"), ("warm_start", 1), ("seed", -1), ("seed", 1.5), ("microbatch_sums", "fold"),
    ("orthogonalization", "qr"), ("orthogonalization", None), ("overlap_backward", "yes"), ("overlap_backward", 1),
    ("tf32", "yes"), ("tf32", 1),
])
def test_bad_value_names_the_key_and_the_fix(key, value):
    with pytest.raises(ValueError, match=rf"nshard\.{key} is .*; (set|remove)") as caught:
        validate_config({**GOOD, key: value})
    assert isinstance(caught.value, ConfigError)


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r'nshard\.ranks is not a known key; did you mean "rank"\? remove it'):
        validate_config({**GOOD, "ranks": 4})


def test_all_problems_come_in_one_error():
    with pytest.raises(ConfigError) as caught:
        validate_config({"rank": 0, "transport": "tcp", "bogus": 1})
    assert len(caught.value.problems) == 3
    for key in ("rank", "transport", "bogus"):
        assert f"nshard.{key}" in str(caught.value)


def test_not_a_dict_is_refused():
    with pytest.raises(ConfigError, match="nshard must be a JSON object"):
        validate_config([("rank", 4)])


def test_build_reducer_validates_before_touching_any_transport():
    # No process group exists here: a ConfigError (not a torch.distributed error) proves the order.
    with pytest.raises(ConfigError, match=r"nshard\.error_feedback"):
        build_reducer({**GOOD, "error_feedback": "gpu"})
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        build_reducer(GOOD)


def test_microbatch_sums_in_the_error_need_device_error_memory():
    with pytest.raises(ConfigError, match=r'nshard\.microbatch_sums is "error".*set error_feedback to "device"'):
        validate_config({**GOOD, "microbatch_sums": "error", "error_feedback": "host"})
    assert validate_config({**GOOD, "microbatch_sums": "error"})["microbatch_sums"] == "error"
