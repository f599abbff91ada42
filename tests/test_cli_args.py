"""The ``cpkv`` command and the cluster scripts refuse bad arguments as they are read, before
Ray starts (no test here starts Ray: every path past the arguments is stubbed)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# NOTE: imported at collection (torch, ~3 s), not within the first test's time.
import cpkv.tools.bench
import cpkv.tools.demo  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture
def runs(monkeypatch):
    """What the command would have run: the tools' entry points and ``ray.init`` stubbed."""
    import ray

    seen: list = []

    def no_ray(*args, **kwargs):
        raise AssertionError(f"Ray was started: ray.init({args}, {kwargs})")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr("cpkv.tools.bench.run_bench", seen.append)
    monkeypatch.setattr("cpkv.tools.bench.run_prefill_bench", seen.append)
    monkeypatch.setattr("cpkv.tools.demo.run_demo", lambda cfg: seen.append(cfg) or 0)
    return seen


def _refused(argv: list[str], capsys) -> str:
    """``cpkv argv`` exits 2 as argparse does; its stderr."""
    from cpkv.tools.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    return err


def _run(argv: list[str], runs: list):
    """``cpkv argv`` goes through to its run; the config it was given."""
    from cpkv.tools.cli import main

    assert main(argv) == 0
    assert len(runs) == 1
    return runs.pop()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "--strategy", "FOO"], "--strategy: invalid choice: 'FOO'"),
        (["bench", "--num-gpus-per-lane", "-1"], "--num-gpus-per-lane: -1.0 must be a finite"),
        (["bench", "--num-gpus-per-lane", "nan"], "--num-gpus-per-lane: nan must be a finite"),
        (["demo", "--num-gpus-per-lane", "-1"], "--num-gpus-per-lane: -1.0 must be a finite"),
        (["bench", "--seed", "-1"], "--seed: -1 must be >= 0"),
        (["demo", "--seed", "-1"], "--seed: -1 must be >= 0"),
        (["bench", "--prefill", "--attention-mode", "foo"], "--attention-mode: invalid choice"),
        (["bench", "--prefill", "--dtype", "foo"], "--dtype: invalid choice: 'foo'"),
        (["bench", "--context", "0"], "--context: '0' is 0 tokens; must be >= 1"),
        (["bench", "--context", "32k,-1k"], "--context: '-1k' is -1024 tokens"),
        (["bench", "--context", "32k,abc"], "--context: 'abc' is not a token count"),
        (["bench", "--context", ","], "--context: ',' names no context length"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_bad_bench_and_demo_values_are_refused_as_read(argv, says, runs, capsys):
    """They passed the parser and failed with a traceback once Ray had started (~20 s)."""
    assert says in _refused(argv, capsys)
    assert not runs


def test_the_choices_are_the_ones_the_code_checks():
    from cpkv.actors.pool import STRATEGIES
    from cpkv.core.steps import MODES
    from cpkv.models.config import DTYPES
    from cpkv.tools.cli import _parser

    bench = _parser()._subparsers._group_actions[0].choices["bench"]
    choices = {a.dest: a.choices for a in bench._actions}
    assert tuple(choices["strategy"]) == STRATEGIES
    assert tuple(choices["attention_mode"]) == MODES
    assert tuple(choices["dtype"]) == DTYPES


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--model", "tiny"),
        ("--dtype", "float32"),
        ("--attention-mode", "pass_q"),
        ("--link-gbps", "100"),
    ],
)
def test_prefill_only_flags_need_prefill(flag, value, runs, capsys):
    """Without --prefill they were ignored without a word; with it they reach the run."""
    err = _refused(["bench", flag, value], capsys)
    assert f"{flag} is read by --prefill only" in err and not runs
    cfg = _run(["bench", "--prefill", flag, value], runs)
    attr = {"--model": "model", "--dtype": "dtype", "--attention-mode": "attention_mode"}
    got = cfg.link_gb_per_s if flag == "--link-gbps" else getattr(cfg, attr[flag])
    assert str(got) == value or got == float(value)


def test_concurrency_is_refused_with_prefill_and_defaults_stay(runs, capsys):
    assert "--concurrency" in _refused(["bench", "--prefill", "--concurrency", "3"], capsys)
    cfg = _run(["bench", "--prefill"], runs)
    assert (cfg.model, cfg.attention_mode, cfg.dtype) == ("small", "auto", None)
    cfg = _run(["bench", "--context", "1k,2K"], runs)
    assert (cfg.concurrency, cfg.contexts) == (2, [1024, 2048])


def test_strict_spread_over_lanes_on_the_embedded_ray_is_refused_at_once(runs, capsys):
    """The embedded Ray has one node: the placement group waited 300 s, then timed out."""
    for argv in (
        ["bench", "--strategy", "STRICT_SPREAD"],  # default lanes 1,2,4,8
        ["bench", "--strategy", "STRICT_SPREAD", "--lanes", "1,2"],
        ["bench", "--prefill", "--strategy", "STRICT_SPREAD", "--lanes", "2"],
        ["bench", "--strategy", "STRICT_SPREAD", "--lanes", "2", "--address", "local"],
    ):
        err = _refused(argv, capsys)
        assert "STRICT_SPREAD" in err and "embedded Ray (no --address) has one node" in err
    assert not runs
    cfg = _run(["bench", "--strategy", "STRICT_SPREAD", "--lanes", "1"], runs)
    assert cfg.strategy == "STRICT_SPREAD"
    cfg = _run(["bench", "--strategy", "STRICT_SPREAD", "--address", "auto"], runs)
    assert cfg.address == "auto"


def test_demo_pages_per_lane_below_the_longest_request_is_refused(runs, capsys):
    """It retried capacity waits for minutes, then failed."""
    from cpkv.core.layout import PageLayout
    from cpkv.tools.demo import DemoConfig

    d = DemoConfig()
    longest = d.prefix_len + d.suffix_lens[1] + d.decode_tokens
    layout = PageLayout(4, 16)
    needed = layout.pages_per_lane_for(layout.pages_for(longest)) + 2
    argv = ["demo", "--cp-size", "4", "--page-size", "16", "--pages-per-lane"]
    err = _refused([*argv, str(needed - 1)], capsys)
    assert f"--pages-per-lane {needed - 1}" in err and f"at least {needed} pages" in err
    assert f"{longest} tokens" in err and not runs
    assert _run([*argv, str(needed)], runs).num_pages_per_lane == needed


def test_address_local_is_the_embedded_ray_on_loopback(runs, monkeypatch):
    """``--address local`` started a fresh Ray without the loopback switch."""
    monkeypatch.delenv(LOOPBACK_VAR, raising=False)  # restored after the test
    cfg = _run(["bench", "--address", "local", "--lanes", "1"], runs)
    assert cfg.address is None
    assert os.environ.get(LOOPBACK_VAR) == "0"


def test_ensure_ray_refuses_local_and_keeps_none_on_loopback(monkeypatch):
    import ray

    from cpkv.actors import ray_env
    from cpkv.errors import InvalidRequestError

    inits: list[dict] = []
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_env._Embedded, "running", False)
    monkeypatch.setattr(ray_env._Embedded, "users", 0)
    monkeypatch.delenv(LOOPBACK_VAR, raising=False)
    for address in ("local", "", "  "):
        with pytest.raises(InvalidRequestError, match="expected None"):
            ray_env.ensure_ray(address, num_lanes=2)
    assert not inits
    assert ray_env.ensure_ray(None, num_lanes=2)
    assert inits[-1]["address"] == "local" and os.environ[LOOPBACK_VAR] == "0"
    assert ray_env.ensure_ray("auto", num_lanes=2)
    assert inits[-1]["address"] == "auto"


def test_local_cluster_refuses_zero_workers_as_read(monkeypatch, capsys):
    monkeypatch.setenv(LOOPBACK_VAR, "0")  # the script sets it; restored after the test
    spec = importlib.util.spec_from_file_location(
        "cpkv_local_cluster_args", ROOT / "cluster" / "local-cluster.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(module, "run", no_cluster)
    monkeypatch.setattr(module, "local_cluster", no_cluster)
    for argv, says in (
        (["--workers", "0"], "--workers: 0 must be >= 1"),
        (["--gpus-per-worker", "0"], "--gpus-per-worker: 0 must be >= 1"),
        (["--head-cpus", "-1"], "--head-cpus: -1 must be >= 0"),
    ):
        with pytest.raises(SystemExit) as info:
            module.main(argv)
        assert info.value.code == 2
        assert says in capsys.readouterr().err


def test_submit_scaling_expands_every_array_safely_under_set_u():
    """``"${a[@]}"`` of an empty array is an unbound variable in bash < 4.4 (macOS 3.2)."""
    text = (ROOT / "cluster" / "submit-scaling.sh").read_text()
    for name in ("wait_flag", "extra", "pkgs"):  # empty without --no-wait, --, or PIP
        assert name + "=" in text or f"-a {name}" in text
        bare = re.findall(r'(?<!\+)"\$\{' + name + r'\[@\]\}"', text)
        assert not bare, f"{name}: bare expansion {bare}"
        assert f'${{{name}[@]+"${{{name}[@]}}"}}' in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_install_replaces_a_torch_older_than_pyproject_asks(tmp_path):
    """An old torch skipped the CPU step, and ``pip install -e .`` then upgraded it from PyPI:
    the CUDA build. Run with a fake torch and pip (pip calls are only logged)."""
    for version, installs_torch in (("2.1.2", True), ("99.0.0+cpu", False)):
        case = tmp_path / version
        (case / "site" / "torch").mkdir(parents=True)
        (case / "site" / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
        log = case / "pip.log"
        py = case / "python"
        py.write_text(
            "#!/usr/bin/env bash\n"
            f'if [ "$1 $2" = "-m pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
            f'PYTHONPATH={case / "site"} exec {sys.executable} "$@"\n'
        )
        py.chmod(0o755)
        env = {"PATH": f"{case}:/usr/bin:/bin", "PYTHON": str(py), "HOME": str(case)}
        script = ROOT / "scripts" / "install.sh"
        subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
        calls = log.read_text().splitlines()
        assert calls[-1].endswith("-e .[test,bench,dev]")
        torch_calls = [c for c in calls[:-1] if "torch" in c]
        assert bool(torch_calls) == installs_torch, (version, calls)
        assert all("torch==" in c or "torch>=2.5" in c for c in torch_calls), calls


def test_make_demo_runs_the_module_of_the_makefiles_python():
    """``cpkv demo`` from PATH may be another install's (or none)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    out = subprocess.run(
        [make, "-n", "-C", str(ROOT), "demo", "PY=/opt/py"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert "/opt/py -m cpkv demo" in out.splitlines()


def test_demo_docstrings_name_objects_that_exist():
    """They named ``cpkv.CPKVClient`` and ``cpkv.PrefillResult``: not exported there."""
    import importlib

    text = (ROOT / "cpkv" / "tools" / "demo.py").read_text()
    refs = set(re.findall(r":(?:meth|attr|class|func):`(cpkv\.[\w.]+)`", text))
    assert refs
    for ref in sorted(refs):
        parts = ref.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for name in parts[i:]:
                assert hasattr(obj, name), f"{ref}: no {name}"
                obj = getattr(obj, name)
            break


def test_a_refused_address_leaves_no_model_checkpoint_behind():
    """The lanes' checkpoint is written before the pool opens: an address refused before
    Ray starts removes it too (it stayed on disk)."""
    from cpkv.actors.pool import LaneOptions, Pool
    from cpkv.core.config import CPConfig, KVShape
    from cpkv.errors import InvalidRequestError

    class Checkpoint:
        removed = 0

        def remove(self) -> None:
            self.removed += 1

    model = Checkpoint()
    config = CPConfig(cp_size=2, page_size=4, num_pages_per_lane=8)
    kv = KVShape(num_heads=2, head_dim=8)
    with pytest.raises(InvalidRequestError, match="expected None"):
        Pool.open("local", "p", config, kv, LaneOptions(), model=model)
    assert model.removed == 1
