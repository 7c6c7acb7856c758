import os
from pathlib import Path

from devices import CUDA_SESSION_VARIABLE, cuda_session, cuda_skip_reason, pin_to_cpu
from nshard.seam.launch_env import extensions_dir

# One model/replay cache for the whole session (and for the ranks the tests launch), inside the checkout.
os.environ.setdefault("NSHARD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "nshard"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The venv's own directory for DeepSpeed's JIT ops, as a launched rank takes it (prepare_process_env), for the
# processes the spawn harness starts too: torch's default is one directory for every venv of the user, where another
# checkout's build, or a stale lock of a killed one, makes an engine built in a test wait.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
if cuda_session():
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
else:  # before torch is imported: the CPU tests must not see a GPU, nor must the processes they start
    pin_to_cpu(os.environ)

import pytest

import launches
import runs


HEAVY_FIRST = ["test_study", "test_launch_scripts", "test_hosts", "test_delta_sync", "test_checkpointing",
               "test_reducer_engine", "test_gpu", "test_resume", "test_gpu_bundle", "test_zero_table",
               "test_study_recovery", "test_ownership", "test_overlap", "test_lm_eval", "test_inputs", "test_capacity",
               "test_grad_count", "test_generate", "test_grow_train", "test_elastic", "test_failures", "test_bf16_step",
               "test_monitors", "test_red_team_resume", "test_arms", "test_chat_data", "test_models", "test_memory_plan",
               "test_replica_check"]
"""pytest-xdist (--dist loadfile --no-loadscope-reorder) hands out whole files in collection order: the longest
first, so the two workers finish together. Every test that brings up launch/hosts.sh's pair (machine-wide
namespace names, a core each) is in test_hosts.py, so they run one at a time."""
FAST_FIRST = ["test_inputs", "test_hosts", "test_generate", "test_analysis", "test_store", "test_red_team_store",
              "test_gpu", "test_failures", "test_models", "test_archive", "test_launch_env", "test_zero_table"]
"""The same for the fast tier (-m "not slow"), whose long files are others: seconds per file of 2d3cc6a's fast tier
(--durations=0, 2-core Xeon with AMX) from test_inputs' 59 s down to test_zero_table's 7 s."""


def pytest_configure(config):
    config.pluginmanager.register(launches.Plugin(config), "nshard-launches")
    config.addinivalue_line("markers", "cuda: runs on a GPU, in the CUDA session only (NSHARD_CUDA_TESTS=1 pytest -m cuda)")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the slow mark added here counts
def pytest_collection_modifyitems(config, items):
    cuda_reason = cuda_skip_reason()
    cpu_reason = f"CPU test: the CUDA session ({CUDA_SESSION_VARIABLE}=1) runs only tests marked cuda"
    for item in items:
        if "runs_root" in getattr(item, "fixturenames", ()):  # it reads launched runs: the slow tier
            item.add_marker(pytest.mark.slow)
        reason = cuda_reason if "cuda" in item.keywords else cpu_reason if cuda_session() else None
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    # Longest files first (HEAVY_FIRST, or FAST_FIRST for the fast tier); within a file the order stays as written.
    longest = FAST_FIRST if (config.option.markexpr or "").replace(" ", "") == "notslow" else HEAVY_FIRST
    rank = {name: i for i, name in enumerate(longest)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).stem, len(rank)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The fast tier (pytest -m "not slow") launches nothing: runs.launch refuses outside a test marked slow."""
    runs.LAUNCH_ALLOWED = item.get_closest_marker("slow") is not None or item.get_closest_marker("cuda") is not None


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory):
    """Shared by every test that launches real runs, so one configuration is launched once per session: with
    pytest-xdist, one folder for all the session's workers (runs.cached_run locks each run's name)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "runs"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def moto(tmp_path_factory):
    """One real S3-API server (moto) on loopback for the session, with the test bucket created."""
    from s3server import MotoServer
    from stores import BUCKET, raw_client

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        raw_client(server.url).create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()
