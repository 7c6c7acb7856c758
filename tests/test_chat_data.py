"""Own chat data: a tiny model fine-tuned on a chat JSONL and on the same rows as a `datasets` parquet, its held-out
loss reported, scored and validated; the prepared identity follows every row, and tokens are cached per file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nshard.run.chat import chat_data
from nshard.run.data import prepare
from nshard.run.models import load_tokenizer, resolve_model
from nshard.run.plan import load_plan
from nshard.run.replay import replay_documents
from runs import REPO, cached_run, run_env, tiny_config

CHAT_PLAN = REPO / "launch/plans/tiny-chat.toml"
DATA = {"train": REPO / "launch/data/chat_train.jsonl", "heldout": REPO / "launch/data/chat_heldout.jsonl"}


def plan_on(tmp: Path, train: Path, heldout: Path) -> Path:
    """The tiny chat plan with its two splits at other paths."""
    text = CHAT_PLAN.read_text().replace('"launch/data/chat_train.jsonl"', json.dumps(str(train)))
    path = tmp / "plan.toml"
    path.write_text(text.replace('"launch/data/chat_heldout.jsonl"', json.dumps(str(heldout))))
    return path


def to_parquet(src: Path, dest: Path, tmp: Path) -> Path:
    import datasets

    datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(tmp / "hf")).to_parquet(str(dest))
    return dest


@pytest.fixture(scope="module")
def chat_runs(runs_root, tmp_path_factory):
    """One tiny launch per format: the JSONL on one rank, the same rows as parquet on two gloo ranks."""
    tmp = tmp_path_factory.mktemp("chat-parquet")
    parquet = plan_on(tmp, to_parquet(DATA["train"], tmp / "train.parquet", tmp),
                      to_parquet(DATA["heldout"], tmp / "heldout.parquet", tmp))
    return {"jsonl": cached_run(runs_root, "chat-jsonl", tiny_config(), world=1, plan=CHAT_PLAN),
            "parquet": cached_run(runs_root, "chat-parquet", tiny_config(), world=2, plan=parquet)}


def documents(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "prepared" / "documents.jsonl").read_text().splitlines()]


def test_own_rows_train_and_their_held_out_loss_is_reported_scored_and_validated(chat_runs, tmp_path):
    from nshard.study.evaluate import score_model
    from nshard.study.validate import ValidationError, validate

    jsonl, parquet = chat_runs["jsonl"], chat_runs["parquet"]
    # The same rows read from a parquet through datasets give the same documents, token for token; the identity
    # differs because it covers the files' own hashes.
    assert documents(jsonl) == documents(parquet)
    sets = [json.loads((r / "prepared" / "sets.json").read_text())["chat"] for r in (jsonl, parquet)]
    assert sets[0]["heldout_ids"] == sets[1]["heldout_ids"] and sets[0]["files"] != sets[1]["files"]
    assert json.loads((jsonl / "run.json").read_text())["prepared_identity"] != \
        json.loads((parquet / "run.json").read_text())["prepared_identity"]
    kinds = [d["kind"] for d in documents(jsonl)]
    assert kinds.count("chat") == 24 and kinds.count("heldout") == 8 and "task" not in kinds
    trained = {i for batch in json.loads((jsonl / "prepared" / "schedule.json").read_text()) for i in batch}
    assert all(kinds[i] != "heldout" for i in trained), "a held-out row was trained on"

    seed_dir = Path(resolve_model("tiny").path)
    seed = score_model("seed", seed_dir, parquet, tmp_path / "seed", commitment=None, exploratory=True,
                       max_new_tokens=8, batch_size=8)
    tuned = score_model("parquet", parquet / "model", parquet, tmp_path / "parquet", commitment=None,
                        exploratory=True, seed_eval=tmp_path / "seed", max_new_tokens=8, batch_size=8)
    assert tuned["heldout"]["docs"] == 8 and tuned["cases"] == 4 and set(tuned["per_family"]) == {"chat"}
    assert tuned["heldout"]["loss_per_token"] < seed["heldout"]["loss_per_token"]
    report = validate(parquet, load_tokenizer(resolve_model("tiny")),
                      {"seed": tmp_path / "seed", "parquet": tmp_path / "parquet"})
    assert report["passed"] and report["evaluations"]["parquet"]["heldout_docs"] == 8
    # Every own answer is generated again and every held-out row scored again; validation lists them as validated.
    checked = report["evaluations"]["parquet"]
    assert checked["regenerated"]["cases"] == 4 and checked["regenerated"]["heldout_docs"] == 8
    assert sorted(checked["heldout_docs_checked"]) == sorted(sets[1]["heldout_ids"])
    assert {r["family"] for r in checked["case_results"].values()} == {"chat"}
    forged_heldout_and_answer_fail_regeneration(tmp_path, parquet, validate, ValidationError)
    # A flipped exact-match flag on an own row is caught, naming the row.
    rows = [json.loads(line) for line in (tmp_path / "parquet" / "cases.jsonl").read_text().splitlines()]
    rows[1]["correct"] = not rows[1]["correct"]
    (tmp_path / "parquet" / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValidationError, match=f"parquet: {rows[1]['case_id']}: re-scoring gives"):
        validate(parquet, load_tokenizer(resolve_model("tiny")), {"seed": tmp_path / "seed",
                                                                  "parquet": tmp_path / "parquet"}, rebuild=False)

    # The command line reports the held-out loss per response token.
    proc = subprocess.run([sys.executable, "-m", "nshard.study.evaluate", "--run", str(jsonl), "--model",
                           str(jsonl / "model"), "--label", "jsonl", "--out", str(tmp_path / "jsonl"), "--exploratory",
                           "--max-new-tokens", "8"], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["heldout_loss_per_token"] < seed["heldout"]["loss_per_token"]


def forged_heldout_and_answer_fail_regeneration(tmp_path: Path, run: Path, validate, ValidationError) -> None:
    """A held-out loss lowered, and an own answer replaced by its expected one, each with every stored file made
    consistent with the forgery: only regeneration can catch them, and it names the row."""
    import shutil

    from nshard.study.evaluate import exact_match, heldout_summary

    tok = load_tokenizer(resolve_model("tiny"))
    lines = lambda path: [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    write = lambda path, rows: path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    forged = tmp_path / "forged-heldout"
    shutil.copytree(tmp_path / "parquet", forged)
    rows = lines(forged / "heldout.jsonl")
    rows[2]["nll_sum"] *= 0.9
    write(forged / "heldout.jsonl", rows)
    summary = json.loads((forged / "summary.json").read_text())
    (forged / "summary.json").write_text(json.dumps({**summary, "heldout": heldout_summary(rows)}))
    with pytest.raises(ValidationError, match=f"forged-heldout: heldout {rows[2]['doc_id']}: scored again"):
        validate(run, tok, {"seed": tmp_path / "seed", "forged-heldout": forged}, rebuild=False)

    forged = tmp_path / "forged-answer"
    shutil.copytree(tmp_path / "parquet", forged)
    rows = lines(forged / "cases.jsonl")
    row = next(r for r in rows if r["generated_ids"] != tok.encode(r["expected"], add_special_tokens=False))
    row["generated_ids"] = tok.encode(row["expected"], add_special_tokens=False)
    row["generated_text"] = tok.decode(row["generated_ids"], skip_special_tokens=True)
    row["correct"] = exact_match(row["generated_text"], row["expected"])
    write(forged / "cases.jsonl", rows)
    summary = json.loads((forged / "summary.json").read_text())
    per_family = {"chat": {"correct": sum(r["correct"] for r in rows), "cases": len(rows)}}
    (forged / "summary.json").write_text(json.dumps({**summary, "per_family": per_family}))
    with pytest.raises(ValidationError, match=f"forged-answer: {row['case_id']}: regenerated answer differs"):
        validate(run, tok, {"seed": tmp_path / "seed", "forged-answer": forged}, rebuild=False)


def test_the_identity_follows_one_changed_row_and_tokens_are_cached_per_file(tmp_path, monkeypatch):
    tok = load_tokenizer(resolve_model("tiny"))  # the model from the session's cache, before it moves
    monkeypatch.setenv("NSHARD_CACHE", str(tmp_path / "cache"))
    files = {split: tmp_path / path.name for split, path in DATA.items()}
    for split, path in DATA.items():
        files[split].write_text(path.read_text())
    plan = load_plan(plan_on(tmp_path, files["train"], files["heldout"]))

    def identity():
        return prepare(plan, tok, replay_documents(plan, None, tok), chat=chat_data(plan, tok))[-1]

    def token_files():
        return sorted(p.name for p in (tmp_path / "cache" / "chat").glob("tokens-*.jsonl"))

    first = identity()
    assert identity() == first and len(token_files()) == 2  # one per split: the second call tokenized nothing
    for split in ("heldout", "train"):
        lines = files[split].read_text().splitlines()
        edited = json.loads(lines[2])
        edited["messages"][-1]["content"] += " Indeed."
        files[split].write_text("\n".join(lines[:2] + [json.dumps(edited)] + lines[3:]) + "\n")
        assert identity() != first, f"changing one {split} row left the identity as it was"
        files[split].write_text("\n".join(lines) + "\n")
        assert identity() == first
    assert len(token_files()) == 4  # each edited file once more; the unchanged one was read from the cache


def test_a_save_to_disk_directory_reads_as_the_same_rows_and_a_dataset_dict_names_its_splits(tmp_path, monkeypatch):
    import datasets

    from nshard.run.chat import read_rows
    from nshard.run.data import DataError

    monkeypatch.setenv("NSHARD_CACHE", str(tmp_path / "cache"))
    table = datasets.load_dataset("json", data_files=str(DATA["heldout"]), split="train", cache_dir=str(tmp_path / "hf"))
    table.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "dict"))
    assert read_rows(tmp_path / "one", "heldout", 1.0)[1] == read_rows(DATA["heldout"], "heldout", 1.0)[1]
    with pytest.raises(DataError, match=r"holds the splits \['test'\]: name one split's directory"):
        read_rows(tmp_path / "dict", "heldout", 1.0)
