"""nshard. Installed, `nshard.analysis` is the repository's analysis/ folder (pyproject.toml maps it there); in a plain
checkout (nothing installed: a lent GPU machine, `python nshard/train.py` from a clone) the finder below maps it the
same way, so the trainer's memory check and the GPU check import it either way."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_CHECKOUT_ANALYSIS = _HERE.parent / "analysis"


class _CheckoutAnalysis(importlib.abc.MetaPathFinder):
    """Finds `nshard.analysis` at ../analysis when this nshard is a checkout's: consulted after every other finder,
    so an installed nshard.analysis (a wheel's, an editable install's) wins."""

    def find_spec(self, name, path=None, target=None):
        if name != "nshard.analysis":
            return None
        return importlib.util.spec_from_file_location(name, _CHECKOUT_ANALYSIS / "__init__.py",
                                                      submodule_search_locations=[str(_CHECKOUT_ANALYSIS)])


if not (_HERE / "analysis").is_dir() and (_CHECKOUT_ANALYSIS / "__init__.py").is_file() \
        and not any(isinstance(f, _CheckoutAnalysis) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutAnalysis())
