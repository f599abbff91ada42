"""The files in cluster/ parse and name what Ray, KubeRay and bash need.

Static checks only: no Ray is started and ray is not imported (the three-node
cluster with the real bench is tested elsewhere).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import py_compile
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
RAY_UP = CLUSTER / "ray-up.yaml"
KUBERAY = CLUSTER / "kuberay-raycluster.yaml"
SUBMIT = CLUSTER / "submit-scaling.sh"
LOCAL = CLUSTER / "local-cluster.py"
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict), f"{path.name}: top level is {type(doc).__name__}, not a mapping"
    return doc


def _containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_template["template"]["spec"]["containers"]


# ------------------------------------------------------------------ all YAML
def test_cluster_folder_has_the_expected_files() -> None:
    for path in (RAY_UP, KUBERAY, SUBMIT, LOCAL, CLUSTER / "README.md"):
        assert path.is_file(), f"missing {path.relative_to(CLUSTER.parent)}"


@pytest.mark.parametrize(
    "path", sorted([*CLUSTER.glob("*.yaml"), *CLUSTER.glob("*.yml")]), ids=lambda p: p.name
)
def test_every_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} is empty"
    assert all(isinstance(d, dict) for d in docs), f"{path.name}: a document is not a mapping"


# ------------------------------------------------------------------ ray up
def test_ray_up_names_the_fields_the_launcher_needs() -> None:
    cfg = _load(RAY_UP)
    assert isinstance(cfg["cluster_name"], str) and cfg["cluster_name"]
    assert cfg["provider"]["type"], "provider.type"
    assert cfg["auth"]["ssh_user"], "auth.ssh_user"
    types = cfg["available_node_types"]
    assert isinstance(types, dict) and types
    for name, node in types.items():
        assert isinstance(node.get("resources"), dict), f"{name}: resources"
        assert isinstance(node.get("node_config"), dict), f"{name}: node_config"
        assert all(isinstance(v, int) and v >= 0 for v in node["resources"].values()), name
        assert node.get("min_workers", 0) <= node.get("max_workers", cfg["max_workers"]), name
    assert cfg["head_node_type"] in types
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head should not take lanes"
    gpu_types = [n for n in types.values() if n["resources"].get("GPU", 0) > 0]
    assert gpu_types, "no worker node type advertises GPUs"


def test_ray_up_start_commands() -> None:
    cfg = _load(RAY_UP)
    head = " ".join(cfg["head_start_ray_commands"])
    worker = " ".join(cfg["worker_start_ray_commands"])
    assert cfg["head_start_ray_commands"][0].strip() == "ray stop"
    assert cfg["worker_start_ray_commands"][0].strip() == "ray stop"
    assert "ray start --head" in head
    assert "--port=6379" in head and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker


def test_ray_up_installs_cpkv() -> None:
    cfg = _load(RAY_UP)
    setup = [
        *cfg.get("setup_commands", []),
        *cfg.get("head_setup_commands", []),
        *cfg.get("worker_setup_commands", []),
    ]
    installs = [c for c in setup if re.search(r"pip install .*cpkv", c)]
    assert installs, "no setup command pip-installs cpkv"
    mounted = cfg.get("file_mounts") or {}
    if any("~/cpkv" in c or "$HOME/cpkv" in c for c in installs):
        assert any(k.rstrip("/").endswith("cpkv") for k in mounted), "install path not mounted"


def test_ray_up_matches_rays_own_schema() -> None:
    """Validate against the schema bundled with the installed Ray (without importing ray)."""
    jsonschema = pytest.importorskip("jsonschema")
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.origin:
        pytest.skip("ray is not installed")
    schema_path = Path(spec.origin).parent / "autoscaler" / "ray-schema.json"
    if not schema_path.is_file():
        pytest.skip(f"no {schema_path}")
    jsonschema.validate(_load(RAY_UP), json.loads(schema_path.read_text()))


# ------------------------------------------------------------------ KubeRay
def test_kuberay_raycluster_shape() -> None:
    rc = _load(KUBERAY)
    assert rc["apiVersion"].startswith("ray.io/")
    assert rc["kind"] == "RayCluster"
    assert rc["metadata"]["name"]
    head = rc["spec"]["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    containers = _containers(head)
    assert containers and all(c.get("image") and c.get("name") for c in containers)
    ports = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    assert {6379, 8265} <= ports, "head must expose GCS 6379 and dashboard/jobs 8265"


def test_kuberay_has_a_gpu_worker_group() -> None:
    groups = _load(KUBERAY)["spec"]["workerGroupSpecs"]
    assert isinstance(groups, list) and groups
    for g in groups:
        assert g["groupName"]
        assert isinstance(g["rayStartParams"], dict)
        assert g.get("minReplicas", 0) <= g["replicas"] <= g.get("maxReplicas", g["replicas"])
    gpu = [
        g
        for g in groups
        if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in _containers(g))
    ]
    assert gpu, "no workerGroupSpec has nvidia.com/gpu in a container's resources.limits"
    assert any(g["groupName"] == "gpu-workers" for g in gpu)


def test_kuberay_containers_install_cpkv_then_start_ray() -> None:
    rc = _load(KUBERAY)
    groups = [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
    overwrite = rc["metadata"].get("annotations", {}).get("ray.io/overwrite-container-cmd")
    for g in groups:
        ray_container = _containers(g)[0]  # KubeRay: the Ray container comes first
        script = " ".join(ray_container.get("args", []))
        assert "pip install" in script and "CPKV_PIP_SPEC" in script
        if overwrite == "true":  # our command replaces KubeRay's: it must still start Ray
            assert "$KUBERAY_GEN_RAY_START_CMD" in script


def test_ray_versions_agree_across_configs() -> None:
    """rayVersion, the KubeRay images and the ray-up images all name one Ray release."""
    rc = _load(KUBERAY)
    version = str(rc["spec"]["rayVersion"])
    images = [
        c["image"]
        for g in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
        for c in _containers(g)
    ]
    docker = _load(RAY_UP).get("docker", {})
    images += [v for k, v in docker.items() if k in ("image", "head_image", "worker_image")]
    ray_images = [i for i in images if i.startswith("rayproject/ray")]
    assert ray_images
    for image in ray_images:
        tag = image.split(":", 1)[1]
        assert tag == version or tag.startswith(version + "-"), f"{image} vs rayVersion {version}"


# ------------------------------------------------------------------ submit script
def test_submit_script_syntax_and_content() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    subprocess.run([bash, "-n", str(SUBMIT)], check=True, timeout=10)
    text = SUBMIT.read_text()
    assert "set -euo pipefail" in text
    assert "ray job submit" in text and "cpkv bench" in text
    assert '"${RAY_ADDRESS:-http://127.0.0.1:8265}"' in text
    for var in ("LANES", "CONTEXT", "REQUESTS", "STRATEGY"):
        assert f"${{{var}:-" in text, f"{var} is not an overridable default"
    assert os.access(SUBMIT, os.X_OK), "submit-scaling.sh is not executable"


def test_submit_script_dry_run_builds_the_command() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    env = {
        **os.environ,
        "LANES": "2,4",
        "CONTEXT": "64k",
        "REQUESTS": "3",
        "STRATEGY": "STRICT_PACK",
        "JOB_ID": "t-1",
        "RAY_ADDRESS": "http://10.1.2.3:8265",
    }
    env.pop("OUT", None)  # the script's own results-dir override; some shells export it
    out = subprocess.run(
        [bash, str(SUBMIT), "--dry-run", "--no-wait", "--", "--no-plot"],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.lstrip().startswith("ray job submit"))
    argv = shlex.split(line)
    assert argv[:3] == ["ray", "job", "submit"]
    submit, bench = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    assert submit[submit.index("--address") + 1] == "http://10.1.2.3:8265"
    assert "--no-wait" in submit and submit[submit.index("--submission-id") + 1] == "t-1"
    runtime_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert isinstance(runtime_env.get("pip"), list)
    assert bench[:2] == ["cpkv", "bench"]
    opts = dict(zip(bench[2::2], bench[3::2], strict=False))
    assert opts["--address"] == "auto"
    assert opts["--lanes"] == "2,4" and opts["--context"] == "64k"
    assert opts["--requests"] == "3" and opts["--strategy"] == "STRICT_PACK"
    assert bench[-1] == "--no-plot"
    assert "/tmp/cpkv-bench/t-1" in out


def test_submit_script_rejects_unknown_options() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    res = subprocess.run([bash, str(SUBMIT), "--bogus"], capture_output=True, text=True, timeout=10)
    assert res.returncode == 2 and "--bogus" in res.stderr


# ------------------------------------------------------------------ local cluster
def test_local_cluster_compiles(tmp_path: Path) -> None:
    py_compile.compile(str(LOCAL), cfile=str(tmp_path / "lc.pyc"), doraise=True)


def _is_loopback_assignment(node: ast.stmt) -> bool:
    """``os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"``."""
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
        return False
    target = node.targets[0]
    return (
        isinstance(target, ast.Subscript)
        and ast.unparse(target.value) == "os.environ"
        and isinstance(target.slice, ast.Constant)
        and target.slice.value == LOOPBACK_VAR
        and isinstance(node.value, ast.Constant)
        and node.value.value == "0"
    )


def _imports_ray(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "ray" or a.name.startswith("ray.") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and bool(node.module) and node.module.split(".")[0] == "ray"
    return False


def test_local_cluster_sets_loopback_before_any_ray_import() -> None:
    tree = ast.parse(LOCAL.read_text())
    sets = [n for n in tree.body if _is_loopback_assignment(n)]
    assert sets, f'no module-level os.environ["{LOOPBACK_VAR}"] = "0"'
    ray_imports = [n for n in ast.walk(tree) if _imports_ray(n)]
    assert ray_imports, "local-cluster.py never imports ray"
    first_set = min(n.lineno for n in sets)
    first_import = min(n.lineno for n in ray_imports)
    assert first_set < first_import, (
        f"{LOOPBACK_VAR} set on line {first_set}, ray imported on line {first_import}"
    )


def test_local_cluster_api_and_cleanup() -> None:
    tree = ast.parse(LOCAL.read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"run", "main"} <= funcs.keys()
    params = [a.arg for a in funcs["run"].args.args]
    assert params[:3] == ["num_workers", "gpus_per_worker", "bench_args"]
    shutdowns = [
        n
        for t in ast.walk(tree)
        if isinstance(t, ast.Try)
        for stmt in t.finalbody
        for n in ast.walk(stmt)
        if isinstance(n, ast.Attribute) and n.attr == "shutdown"
    ]
    assert shutdowns, "no cluster.shutdown() in a finally block"
    assert "ray.cluster_utils" in LOCAL.read_text()


@pytest.fixture
def local_cluster_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """cluster/local-cluster.py loaded as a module; it imports ray only lazily."""
    monkeypatch.setenv(LOOPBACK_VAR, "0")  # restores the caller's value afterwards
    spec = importlib.util.spec_from_file_location("cpkv_local_cluster", LOCAL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module


def test_local_cluster_passes_bench_args_and_address(
    local_cluster_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = local_cluster_module
    started: list[tuple] = []
    calls: list[list[str]] = []

    class FakeCluster:
        address = "127.0.0.1:6390"

    @contextlib.contextmanager
    def fake_local_cluster(*args: Any, **kwargs: Any) -> Iterator[FakeCluster]:
        started.append((args, kwargs))
        yield FakeCluster()

    monkeypatch.setattr(lc, "local_cluster", fake_local_cluster)
    monkeypatch.setattr(lc, "_call_bench", lambda argv: calls.append(argv) or 7)

    rc = lc.main(["--workers", "3", "--gpus-per-worker", "1", "--", "--lanes", "1,3"])
    assert rc == 7
    assert started[0][0] == (3, 1.0)
    assert calls[-1] == ["bench", "--lanes", "1,3", "--address", "127.0.0.1:6390"]

    lc.main(["--lanes", "2", "--address", "auto"])  # unknown options pass through
    assert calls[-1] == ["bench", "--lanes", "2", "--address", "auto"]

    lc.main([])  # defaults: lane counts that fit 2 workers x 2 GPUs
    argv = calls[-1]
    assert argv[argv.index("--lanes") + 1] == "1,2,4"
    assert argv[argv.index("--strategy") + 1] == "SPREAD"
    assert argv[-2:] == ["--address", "127.0.0.1:6390"]


def test_local_cluster_rejects_bad_sizes(local_cluster_module: ModuleType) -> None:
    with pytest.raises(ValueError, match="num_workers=0"):
        local_cluster_module.start_cluster(0, 2)
    with pytest.raises(ValueError, match="gpus_per_worker=0"):
        local_cluster_module.start_cluster(2, 0)


@pytest.mark.parametrize("counts", [{"gpus_per_worker": 0.5}, {"cpus_per_worker": 1.5}])
def test_local_cluster_refuses_fractional_node_counts_before_ray(counts) -> None:
    """Ray takes only whole counts for a node: 0.5 GPUs a worker died in Ray's traceback."""
    spec = importlib.util.spec_from_file_location("local_cluster", LOCAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # cpkv's own message (Ray's later one says "whole numbers" too, after a node started)
    with pytest.raises(ValueError, match=r"cpus_per_worker=.*: whole numbers of each"):
        module.start_cluster(2, **counts)
