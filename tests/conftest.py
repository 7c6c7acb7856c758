import os
from pathlib import Path

from devices import CUDA_SESSION_VARIABLE, cuda_session, cuda_skip_reason, pin_to_cpu

# One model/replay cache for the whole session (and for the ranks the tests launch), inside the checkout.
os.environ.setdefault("NSHARD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "nshard"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
if cuda_session():
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
else:  # before torch is imported: the CPU tests must not see a GPU, nor must the processes they start
    pin_to_cpu(os.environ)

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a GPU, in the CUDA session only (NSHARD_CUDA_TESTS=1 pytest -m cuda)")


def pytest_collection_modifyitems(config, items):
    cuda_reason = cuda_skip_reason()
    cpu_reason = f"CPU test: the CUDA session ({CUDA_SESSION_VARIABLE}=1) runs only tests marked cuda"
    for item in items:
        reason = cuda_reason if "cuda" in item.keywords else cpu_reason if cuda_session() else None
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory):
    """Shared by every test that launches real runs, so one configuration is launched once per session."""
    return tmp_path_factory.mktemp("runs")


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
