"""Starting or attaching to Ray, with local runs kept on loopback."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("cpkv")

NAMESPACE = "cpkv"


def local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken: no GPUs for placement
        return 0


def ensure_ray(
    address: str | None, *, num_cpus: float | None = None, num_gpus: float | None = None
) -> bool:
    """Attach to Ray, or start an embedded local one; return True when we started it.

    ``address=None`` starts a local Ray bound to 127.0.0.1 (logical GPUs when the
    machine has none); ``"auto"`` or ``"ray://host:port"`` attaches to a cluster.
    """
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return False
    # NOTE: must be set before Ray starts, or it binds the machine's outward address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        include_dashboard=False,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        namespace=NAMESPACE,
        log_to_driver=True,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    return True
