"""python -m nshard.study: the study runner (nshard/study/runner.py)."""

import sys

from nshard.study.runner import main

sys.exit(main())
