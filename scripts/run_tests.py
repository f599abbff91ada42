"""Run the test suite; fail on failures and also when no test ran (pytest exit 5).

With pytest-xdist installed (the ``test`` extra), the suite runs on ``CPKV_TEST_WORKERS``
workers (default 2; 1 runs it in this process): the tests of the shared local Ray stay on
one worker, in order (``tests/conftest.py``), and the rest run beside them.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest


def _worker_args(args: list[str]) -> list[str]:
    workers = int(os.environ.get("CPKV_TEST_WORKERS", "2"))
    asked = any(a.startswith(("-n", "--numprocesses", "--dist")) for a in args)
    if workers <= 1 or asked or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(workers), "--dist", "loadgroup"]


if __name__ == "__main__":
    # Ray must bind loopback only; set before any test imports ray.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    argv = sys.argv[1:]
    code = pytest.main(["-q", *_worker_args(argv), *argv])
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("run_tests: no tests ran; failing", file=sys.stderr)
        code = 1
    sys.exit(int(code))
