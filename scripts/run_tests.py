"""Run the test suite; fail on failures and also when no test ran (pytest exit 5)."""

from __future__ import annotations

import os
import sys

import pytest

if __name__ == "__main__":
    # Ray must bind loopback only; set before any test imports ray.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    code = pytest.main(["-q", *sys.argv[1:]])
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("run_tests: no tests ran; failing", file=sys.stderr)
        code = 1
    sys.exit(int(code))
