"""scripts/run_tests.py, the README's test command: it fails when a test fails and when no
test ran (pytest's exit 5), and spreads the suite over pytest-xdist workers unless told not to."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_tests.py"


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_one.py").write_text(body)
    env = {**os.environ, "CPKV_TEST_WORKERS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    "body, code",
    [
        ("def test_ok():\n    assert True\n", 0),
        ("def test_bad():\n    assert False\n", 1),
        ("def helper():\n    pass\n", 1),  # no test ran: pytest's 5 must fail too
    ],
    ids=["passes", "a-test-fails", "no-test-ran"],
)
def test_the_runner_fails_when_a_test_fails_or_none_ran(tmp_path, body, code):
    out = _run(tmp_path, body)
    assert out.returncode == code, out.stdout + out.stderr
    if "helper" in body:
        assert "no tests ran" in out.stderr


def test_workers_unless_told_otherwise(monkeypatch):
    spec = importlib.util.spec_from_file_location("run_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    has_xdist = importlib.util.find_spec("xdist") is not None
    monkeypatch.setenv("CPKV_TEST_WORKERS", "2")
    expected = ["-n", "2", "--dist", "loadgroup"] if has_xdist else []
    assert module._worker_args(["tests"]) == expected
    assert module._worker_args(["-n", "4"]) == []  # the caller's own choice stands
    monkeypatch.setenv("CPKV_TEST_WORKERS", "1")
    assert module._worker_args(["tests"]) == []
