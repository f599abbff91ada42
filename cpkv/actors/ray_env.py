"""Starting or attaching to Ray, with local runs kept on loopback."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("cpkv")

NAMESPACE = "cpkv"


def local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken: no GPUs for placement
        return 0


def keep_ray_on_loopback() -> None:
    """Make a Ray started from this process bind 127.0.0.1 only (unless told otherwise).

    NOTE: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when ``ray`` is imported;
    its child processes read the environment, and a driver that imported Ray
    already gets the same value set on Ray's constant.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        constants.ENABLE_RAY_CLUSTER = False


def ensure_ray(
    address: str | None, *, num_cpus: float | None = None, num_gpus: float | None = None
) -> bool:
    """Attach to Ray, or start an embedded local one; return True when we started it.

    ``address=None`` starts a local Ray bound to 127.0.0.1 (logical GPUs when the
    machine has none); ``"auto"`` or ``"ray://host:port"`` attaches to a cluster.
    """
    if address is None:
        keep_ray_on_loopback()
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return False
    ray.init(
        address="local",  # a new Ray of our own, never one found via RAY_ADDRESS or /tmp/ray
        include_dashboard=False,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        namespace=NAMESPACE,
        log_to_driver=True,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    return True
