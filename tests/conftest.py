import os
from pathlib import Path

# One model/replay cache for the whole session (and for the ranks the tests launch), inside the checkout.
os.environ.setdefault("NSHARD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "nshard"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory):
    """Shared by every test that launches real runs, so one configuration is launched once per session."""
    return tmp_path_factory.mktemp("runs")
