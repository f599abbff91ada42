"""One local Ray for the whole test session, on loopback, with logical GPUs."""

from __future__ import annotations

import os
import uuid

# NOTE: set before Ray starts, or it binds the machine's outward address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

import pytest


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


# With real GPUs the lanes pack on them (small fractions, CUDA shards); without,
# 16 logical GPUs make GPU placement testable on CPU.
CUDA_DEVICES = _cuda_devices()
NUM_GPUS = CUDA_DEVICES or 64
GPUS_PER_LANE = 0.5 if not CUDA_DEVICES else 0.05


# NOTE: the kernel tests' modules turn Triton's interpreter on when they are collected, and
# processes Ray starts inherit it: lanes on CPU then ran every attention through the
# interpreter, ~10x slower (the demo test: 107 s in the suite, 9.5 s alone). Lanes on CPU
# use the torch references; the kernels are tested on their own and, through CP attention,
# in this process (tests/test_cp_attention.py).
LANE_ENV = {"TRITON_INTERPRET": "0"}


def _uses_shared_ray(item) -> bool:
    return item.get_closest_marker("ray") is not None or "ray_session" in getattr(
        item, "fixturenames", ()
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list) -> None:
    """Tests that want a quiet Ray run first, before any pooled client exists: otherwise
    :func:`quiet_ray` shuts the pools down and the next tests start them again (a cp=4
    pool costs ~8 s on 2 cores).

    Under ``pytest -n N --dist loadgroup`` (``scripts/run_tests.py``) every test of the
    shared Ray is one group, run by one worker in this order with the session's one Ray and
    its pools; the others (kernels under the interpreter, the decision core's state
    machines) run on the other workers meanwhile.
    """
    items.sort(key=lambda item: "quiet_ray" not in getattr(item, "fixturenames", ()))
    for item in items:
        if _uses_shared_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_session():
    """Start Ray once (CPU machine: logical GPUs make GPU placement testable)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    ray.init(
        address="local",  # our own Ray, even when another runs on this machine
        include_dashboard=False,
        num_cpus=16,
        num_gpus=NUM_GPUS,
        namespace="cpkv",
        logging_level="ERROR",
        log_to_driver=False,
        runtime_env={"env_vars": LANE_ENV},
    )
    yield ray
    ray.shutdown()


DEFAULTS = dict(
    cp_size=4,
    page_size=4,
    num_pages_per_lane=32,
    max_reqs=32,
    max_context_len=4096,
    num_heads=2,
    head_dim=8,
    dtype="float32",
    num_gpus_per_lane=GPUS_PER_LANE,
    heartbeat_s=0.2,
    # First calls on a GPU compile the Triton kernels (tens of seconds each).
    timeout_s=30.0 if not CUDA_DEVICES else 300.0,
)
# The whole Ray suite with steps through a compiled graph (tests/test_compiled_steps.py runs
# its own pools so either way): CPKV_TEST_COMPILED_STEPS=1 pytest tests/...
if os.environ.get("CPKV_TEST_COMPILED_STEPS") == "1":
    DEFAULTS["compiled_steps"] = True


# Pools kept alive at once: each lane is a process of a few hundred MB, and the session
# runs pools of many shapes (cp 1-4, with and without a model) on 2 cores and 24 GiB.
MAX_POOLS = 3


def _key(opts: dict) -> tuple:
    return tuple(sorted(opts.items(), key=lambda kv: kv[0]))


_DEFAULT_KEY = _key(DEFAULTS)


def _compiled(key: tuple) -> bool:
    return bool(dict(key).get("compiled_steps"))


@pytest.fixture(scope="session")
def _client_pool(ray_session):
    """Clients by configuration, kept for the session (starting lanes costs seconds); the
    least recently used is shut down beyond :data:`MAX_POOLS`."""
    pool: dict = {}
    yield pool
    for client in pool.values():
        client.shutdown()


@pytest.fixture(scope="module")
def _module_shapes(_client_pool):
    """The pooled shapes a module asked for; when it ends, their pools other than the default
    shape are shut down. Modules hardly share them (one that did found its pool evicted by
    then), and an idle pool is not free: its coordinator heartbeats every lane each
    ``heartbeat_s`` (~0.1 core for a cp=4 pool), on the 2 cores the other tests run on."""
    shapes: set = set()
    yield shapes
    for key in shapes - {_DEFAULT_KEY}:
        client = _client_pool.pop(key, None)
        if client is not None:
            client.shutdown()


@pytest.fixture
def make_client(_client_pool, _module_shapes):
    """Give a client of the asked shape, reset to an empty pool.

    ``fresh=True`` makes a new coordinator and lanes, shut down after the test
    (for tests that kill the coordinator or need their own name).
    """
    import cpkv

    own = []
    handed: set = set()  # the pooled shapes this test has

    def make(fresh: bool = False, **kwargs):
        opts = {**DEFAULTS, **kwargs}
        key = _key(opts)
        # NOTE: a compiled pool's graphs poll for their next step (a core a lane, and the
        # coordinator's once a step ran) until ~10 s after its last step: one left in the
        # cache by an earlier test is shut down as soon as a test asks for another pool.
        keep = {key, _DEFAULT_KEY, *handed}
        for idle in [k for k in _client_pool if _compiled(k) and k not in keep]:
            _client_pool.pop(idle).shutdown()
        if fresh or "name" in kwargs:
            opts.setdefault("name", f"coord-{uuid.uuid4().hex[:8]}")
            client = cpkv.connect(**opts)
            own.append(client)
            return client
        handed.add(key)
        _module_shapes.add(key)
        client = _client_pool.pop(key, None)
        if client is None:
            while len(_client_pool) >= MAX_POOLS + (_DEFAULT_KEY in _client_pool):
                # NOTE: the default shape is never evicted: most tests ask for it, and a
                # cp=4 pool costs ~8 s to start on 2 cores (four processes importing torch).
                oldest = next(k for k in _client_pool if k != _DEFAULT_KEY)
                _client_pool.pop(oldest).shutdown()
            opts["name"] = f"coord-{uuid.uuid4().hex[:8]}"
            client = cpkv.connect(**opts)
        else:
            client.reset()
        _client_pool[key] = client  # most recently used last
        return client

    yield make
    for client in own:
        client.shutdown()


@pytest.fixture
def attach(make_client):
    """Another client of a pooled client's coordinator (``namespace=`` etc. in kwargs),
    shut down after the test; the pool stays. Tests of two clients on one coordinator use
    it instead of a pool of their own."""
    import cpkv

    attached = []

    def go(client, **kwargs):
        other = cpkv.connect(**{**DEFAULTS, "name": client.name, **kwargs})
        attached.append(other)
        return other

    yield go
    for other in attached:
        other.shutdown()


@pytest.fixture
def quiet_ray(ray_session, _client_pool):
    """The session's Ray with no pooled clients left running (their heartbeats and lanes
    would share the 2 cores with a timing-sensitive run such as the demo)."""
    while _client_pool:
        _client_pool.pop(next(iter(_client_pool))).shutdown()
    yield ray_session
