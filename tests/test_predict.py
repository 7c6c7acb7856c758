"""nshard.predict: the model's arithmetic on synthetic short runs, the recommendation as the link changes, the link
read from bench_link's JSON, and bad input refused with an error that names the fix. Fast tier: nothing trains."""

import json
import math

import pytest

from nshard import predict as p

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
          "tie_word_embeddings": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
PHASES = {"forward_backward": 2.0, "reducer_compute": 0.1, "collective_wait": 0.05, "optimizer_step": 0.3,
          "parameter_sync": 0.0, "rest": 0.02}


def parameter_count() -> int:
    """The synthetic model's parameters, counted by transformers itself (tied embeddings counted once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return sum(t.numel() for t in LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items()
                                                                   if k not in ("architectures", "model_type")}))
               .parameters())


def short_run(path, updates=3, phases=None, microbatch_s=None, prepared=None, world=1, compressed=None):
    """A run directory as nshard/train.py leaves it, with only what the predictor reads."""
    (path / "model").mkdir(parents=True)
    (path / "model" / "config.json").write_text(json.dumps(CONFIG))
    (path / "receipts").mkdir()
    (path / "receipts" / "rank-0.json").write_text(json.dumps({"device": "cpu", "world_size": world}))
    (path / "run.json").write_text(json.dumps({"world_size": world, "reducer": "dense", "zero_stage": 0,
                                               "model": {"spec": "tiny"}}))
    rows = []
    for u in range(updates):
        split = dict(phases or PHASES)
        rows.append({"update": u + 1, "update_s": math.fsum(split.values()), "deepspeed_grad_bytes": 4,
                     "compressed": bool(compressed and compressed[u]), "phases": split,
                     "microbatch_s": microbatch_s[u] if microbatch_s else [split["forward_backward"]]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if prepared:
        lengths, schedule, microbatch = prepared
        (path / "plan.toml").write_text(f"[train]\nmicrobatch_docs = {microbatch}\n")
        (path / "prepared").mkdir()
        (path / "prepared" / "schedule.json").write_text(json.dumps(schedule))
        (path / "prepared" / "documents.jsonl").write_text(
            "".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in lengths))
    return path


def fixed_probe(seconds):
    return lambda shapes, config, hosts, threads, repeats: {"reducer_compute_s": seconds}


def test_a_two_host_update_is_the_hand_computed_sum_of_its_parts(tmp_path):
    run = p.read_run(short_run(tmp_path / "run"))
    link = p.Link(bits_per_s=1e8, rtt_s=0.002, source="test")
    result = p.predict(run, link, hosts=2, ranks=[4], powersgd_config={"rank": 4, "dense_warmup_updates": 1},
                       probe=fixed_probe(0.25))
    options = {o["name"]: o for o in result["options"]}
    n = parameter_count()
    assert options["dense"]["payload_bytes"] == 4 * n
    # No prepared inputs: half the batch per rank halves forward_backward. One gradient all-reduce plus
    # DeepSpeed's 4-byte one, each a round trip on a ring of two; the short run's collective_wait is replaced.
    dense = 2.0 / 2 + 0.1 + (4 * n * 8 / 1e8 + 2 * 0.002) + 0.3 + 0.0 + 0.02
    assert options["dense"]["update_s"] == pytest.approx([dense] * 3, rel=1e-12)
    one = math.fsum(PHASES.values())
    assert options["one host"]["update_s"] == pytest.approx([one] * 3, rel=1e-12)

    from nshard.comm.layout import build_layout

    layout = build_layout(run.shapes, 4, 2)
    sent = 4 * (layout.p_numel + layout.q_numel + sum(math.prod(layout.shapes[k]) for k in layout.dense_names))
    assert 0 < sent < 4 * n and options["powersgd r=4"]["payload_bytes"] == sent
    compressed = 2.0 / 2 + 0.25 + (sent * 8 / 1e8 + 4 * 0.002) + 0.3 + 0.02  # remainder, P, Q, the scalar
    psgd = options["powersgd r=4"]
    assert psgd["update_s"] == pytest.approx([dense, compressed, compressed], rel=1e-12)  # the warm-up is dense
    assert psgd["run_s"] == pytest.approx(dense + 2 * compressed)
    assert psgd["speedup"] == pytest.approx(3 * one / (dense + 2 * compressed))


def test_the_slowest_ranks_microbatches_set_forward_backward(tmp_path):
    # Four one-document microbatches, longest first on one rank: 4, 1, 1, 1 s. On two ranks they are dealt
    # 0 1 1 0, so rank 0 runs the 4 s and the last 1 s one: 5 s, not half of 7.
    lengths, schedule = [10, 20, 30, 40], [[0, 1, 2, 3]]
    run = p.read_run(short_run(tmp_path / "run", updates=1, phases={**PHASES, "forward_backward": 7.0},
                               microbatch_s=[[4.0, 1.0, 1.0, 1.0]], prepared=(lengths, schedule, 1)))
    assert p.rank_forward_backward(run, 0, 2) == pytest.approx(5.0)
    assert p.rank_forward_backward(run, 0, 1) == pytest.approx(7.0)
    # Three microbatches on two ranks: the rank with one reruns it as a filler (4 + 4), the other runs 1 + 1.
    odd = p.read_run(short_run(tmp_path / "odd", updates=1, phases={**PHASES, "forward_backward": 6.0},
                               microbatch_s=[[4.0, 1.0, 1.0]], prepared=([10, 20, 30], [[0, 1, 2]], 1)))
    assert p.rank_forward_backward(odd, 0, 2) == pytest.approx(8.0)


def test_the_recommendation_moves_from_powersgd_to_dense_to_one_host_with_the_link(tmp_path):
    # Compute-heavy short run with a costly PowerSGD: a slow link favours PowerSGD, a fast one dense.
    run = p.read_run(short_run(tmp_path / "run", phases={**PHASES, "forward_backward": 4.0}))
    config = {"rank": 4, "dense_warmup_updates": 0}

    def choice(bits, probe_s, fb_run=run):
        result = p.predict(fb_run, p.Link(bits, 0.0, "test"), ranks=[4], powersgd_config=config,
                           probe=fixed_probe(probe_s))
        return result["recommendation"]

    assert choice(1e6, 0.5)["choice"] == "powersgd r=4"
    fast = choice(1e11, 0.5)
    assert fast["choice"] == "dense" and fast["margin_over_next"] > 1
    # When communication dominates (a slow link and a short update), one host wins, with its margin stated.
    quick = p.read_run(short_run(tmp_path / "quick", phases={**PHASES, "forward_backward": 0.01}))
    stay = choice(1e5, 0.5, quick)
    assert stay["choice"] == "one host" and stay["speedup"] == 1.0
    assert "stay on one host" in stay["text"] and "slower" in stay["text"]


def test_concurrent_compute_slows_every_phase_but_the_wire(tmp_path):
    run = p.read_run(short_run(tmp_path / "run", updates=1))
    plain, shared = (p.predict(run, p.Link(1e8, 0.0, "t", factor), ranks=[4], probe=fixed_probe(0.2),
                               powersgd_config={"rank": 4}) for factor in (1.0, 1.5))
    for a, b in zip(plain["options"][1:], shared["options"][1:]):
        wire = a["median_phase_s"]["collective_wait"]
        assert b["median_phase_s"]["collective_wait"] == wire > 0
        assert b["update_s"][0] - wire == pytest.approx(1.5 * (a["update_s"][0] - wire))
    assert plain["options"][0]["update_s"] == shared["options"][0]["update_s"]  # one host computes alone


def test_updates_past_the_short_run_repeat_its_later_updates(tmp_path):
    run = p.read_run(short_run(tmp_path / "run", updates=3))
    run.updates[0]["phases"]["rest"] = 5.0  # the first update paid one-time costs
    for warmup in (2, 8):  # a warm-up longer than the short run still predicts the compressed updates after it
        result = p.predict(run, p.Link(1e9, 0.0, "t"), ranks=[4],
                           powersgd_config={"rank": 4, "dense_warmup_updates": warmup}, updates=10,
                           probe=fixed_probe(0.1))
        one, dense, psgd = result["options"]
        source = [0, 1, 2, 1, 2, 1, 2, 1, 2, 1]  # the short run's updates, then its later ones in turn
        assert one["update_s"] == [math.fsum(run.updates[j]["phases"].values()) for j in source]
        assert psgd["compressed"] == [i >= warmup for i in range(10)]
        # The probe's 0.1 s equals the short run's dense reducer_compute: a compressed update differs by its wire.
        wire = {o["name"]: o["median_phase_s"]["collective_wait"] for o in (dense, psgd)}
        for i in range(10):
            shift = wire["powersgd r=4"] - wire["dense"] if i >= warmup else 0.0
            assert psgd["update_s"][i] == pytest.approx(dense["update_s"][i] + shift)
        assert psgd["update_s"][0] - psgd["update_s"][1] == pytest.approx(5.0 - 0.02)  # the first one's extra rest
        assert psgd["run_s"] == pytest.approx(math.fsum(psgd["update_s"]))
        assert psgd["median_compressed_update_s"] == pytest.approx(psgd["update_s"][-1])


def test_the_link_is_read_from_bench_links_dense_arm(tmp_path):
    def bench(rates):
        arms = {"dense": {"bytes_per_update": {"ledger": 10_000_000}, "median_reduce_s_rank0": 1.1},
                "one": {"median_update_s": 2.0}, "local": {"median_update_s": 2.5}}
        return {"settings": {"rates": ",".join(rates)},
                "models": {"135m": {"rates": {r: {"arms": arms} for r in rates}}}}

    path = tmp_path / "bench_link.json"
    path.write_text(json.dumps(bench(["1gbit"])))
    link = p.link_from_bench(path, None, 1e-8, 0.0)  # 0.1 s of flatten and copy taken out
    assert link.bits_per_s == pytest.approx(10_000_000 * 8 / 1.0)
    # The bench's local arm over its one arm is reported, not applied (its updates are bound by memory).
    assert link.concurrent_compute == 1.0 and "local arm over its one arm 1.25x" in link.source
    assert p.link_from_bench(path, None, 1e-8, 0.0, concurrent_compute=1.3).concurrent_compute == 1.3
    # With the raw samples beside it, each round's faster rank counts (the slower rank's wait is not the link).
    samples = lambda seconds: [{"rate": "1gbit", "arm": "dense", "reduce_s": s} for s in seconds]
    (tmp_path / "135m.raw.json").write_text(json.dumps({"samples_by_rank": [samples([0.6, 2.0, 0.9]),
                                                                             samples([0.9, 0.7, 0.6])]}))
    assert p.link_from_bench(path, "1gbit", 0.0, 0.0).bits_per_s == pytest.approx(10_000_000 * 8 / 0.6)
    path.write_text(json.dumps(bench(["100mbit", "1gbit"])))
    with pytest.raises(p.PredictError, match="--link_rate"):
        p.link_from_bench(path, None, 0.0, 0.0)
    with pytest.raises(p.PredictError, match="use one of those"):
        p.link_from_bench(path, "10gbit", 0.0, 0.0)


def test_bad_input_is_refused_naming_the_fix(tmp_path, capsys):
    with pytest.raises(p.PredictError, match="does not exist"):
        p.read_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(p.PredictError, match="no metrics.jsonl: give the --out directory"):
        p.read_run(tmp_path / "empty")
    old = short_run(tmp_path / "old")
    rows = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        del row["phases"]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(p.PredictError, match="has no phases .update_phases.*rerun the short run"):
        p.read_run(old)
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        p.main([str(tmp_path / "empty"), "--link_mbit", "1000"])
    good = short_run(tmp_path / "good")
    for argv, match in ((["--link_mbit", "1000", "--link_rate", "1gbit"], "give --link too"),
                        (["--link_mbit", "0"], "above 0"),
                        (["--link_mbit", "1", "--concurrent_compute", "0"], "above 0"),
                        (["--link_mbit", "1000", "--hosts", "1"], "2 or more"),
                        (["--link_mbit", "1000", "--powersgd_ranks", "4,x"], "positive whole numbers"),
                        (["--link", str(tmp_path / "none.json")], "run launch/bench_link.py first")):
        with pytest.raises(SystemExit, match=match):
            p.main([str(good), *argv])
    with pytest.raises(SystemExit):  # argparse: one of --link, --link_mbit is required
        p.main([str(good)])
    err = capsys.readouterr().err
    assert "--link" in err and "is required" in err


def test_payload_and_all_reduces_are_what_the_reducers_send(tmp_path):
    """payload() against nshard's own reducers run on the model's shapes over a transport that counts its calls."""
    import torch

    from nshard.comm import DenseReducer, PowerSGDReducer
    from nshard.comm.config import parse_config

    shapes = p.read_run(short_run(tmp_path / "run")).shapes

    class Counting(p.LocalTransport):
        calls = 0

        def all_reduce_sum_(self, tensor):
            self.calls += 1
            return super().all_reduce_sum_(tensor)

    for reducer, rank in (("dense", None), ("powersgd", 4), ("powersgd", 16)):
        transport = Counting(2)
        built = (DenseReducer(transport) if reducer == "dense" else
                 PowerSGDReducer(parse_config({"reducer": "powersgd", "rank": rank, "dense_warmup_updates": 0}),
                                 transport))
        built.reduce({name: torch.randn(shape) for name, shape in shapes.items()})
        assert p.payload(shapes, reducer, rank) == (sum(built.ledger.records[-1]["bytes"].values()), transport.calls)
    probed = p.probe_powersgd(shapes, {"rank": 4}, 2, 1, 1)
    assert probed["reducer_compute_s"] > 0 and set(probed["detail_s"]) == {"powersgd_pq", "orthogonalize",
                                                                            "error_update"}


def test_the_command_prints_a_table_and_writes_the_json(tmp_path, capsys):
    run = short_run(tmp_path / "run")
    out = tmp_path / "predict.json"
    p.main([str(run), "--link_mbit", "100", "--powersgd_ranks", "4", "--probe_repeats", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert [o["name"] for o in written["options"]] == ["one host", "dense", "powersgd r=4"]
    assert f"recommendation: {written['recommendation']['text']}" in printed
    assert "| powersgd r=4 |" in printed and written["link"]["bits_per_s"] == 1e8
    p.main([str(run), "--link_mbit", "100", "--powersgd_ranks", "4", "--probe_repeats", "1", "--json", "-"])
    assert json.loads(capsys.readouterr().out)["options"][2]["reducer_compute_from"].startswith("probe")


def test_a_run_or_ds_config_with_overlap_backward_is_refused(tmp_path):
    """The model puts the communication after the compute: a run that reduced during backward is not predicted."""
    run = short_run(tmp_path / "overlap")
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "nshard": {"reducer": "powersgd", "transport": "torch", "overlap_backward": True}}
    (run / "ds_config.json").write_text(json.dumps({**config, "nshard": {**config["nshard"], "overlap_backward": False}}))
    assert p.read_run(run).path == run  # the same run with it off is read
    (run / "ds_config.json").write_text(json.dumps(config))
    with pytest.raises(p.PredictError, match="ran with nshard.overlap_backward true .*with overlap_backward false"):
        p.read_run(run)
    with pytest.raises(SystemExit, match="overlap_backward"):
        p.main([str(run), "--link_mbit", "1000"])
    (tmp_path / "overlap.json").write_text(json.dumps(config))
    plain = p.read_run(short_run(tmp_path / "plain"))
    with pytest.raises(p.PredictError, match="sets nshard.overlap_backward true.*overlap_backward false"):
        p.powersgd_section(plain, tmp_path / "overlap.json")
