"""Starting or attaching to Ray, with local runs kept on loopback: the one Ray starter."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

__all__ = [
    "NAMESPACE",
    "check_address",
    "embedded_ray_released",
    "ensure_ray",
    "keep_ray_on_loopback",
    "local_gpu_count",
    "take_embedded_ray",
    "tool_ray",
]

logger = logging.getLogger("cpkv")

NAMESPACE = "cpkv"


class _Embedded:
    """The local Ray this process started (``address=None``) and how many of its pools still
    use it: the last to let go shuts it down (not the first, under the others)."""

    running = False
    users = 0


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


def check_address(address: object) -> str | None:
    """``address`` when it names how to start or reach Ray as :func:`ensure_ray` means.

    Raises:
        InvalidRequestError: ``"local"`` (Ray's own spelling of a fresh local Ray: it would
            skip the loopback setting that only ``None`` applies), an empty string or a
            non-string.
    """
    if address is None:
        return None
    if not isinstance(address, str) or not address.strip() or address.strip() == "local":
        from cpkv.errors import InvalidRequestError

        raise InvalidRequestError(
            f"address={address!r}; expected None (an embedded Ray on 127.0.0.1), 'auto', "
            "'ray://host:port' or 'host:port'"
        )
    return address


def ensure_ray(address: str | None, *, num_lanes: int, quiet: bool = False) -> bool:
    """Attach to Ray, or start an embedded local one, unless this process has Ray already.

    Args:
        address: ``None`` starts a local Ray bound to 127.0.0.1 with room for ``num_lanes``
            lanes (logical GPUs when the machine has none); ``"auto"`` or
            ``"ray://host:port"`` attaches to a cluster.
        num_lanes: lanes the local Ray must hold.
        quiet: worker output is not forwarded to this terminal and Ray logs errors only, so
            no lane log line or Ray warning tears through a progress bar (the tools).

    Returns:
        True when this call initialised Ray in this process (the caller shuts it down).

    Raises:
        InvalidRequestError: an address of no form above (``"local"``: pass ``None``).
    """
    check_address(address)
    if address is None:
        keep_ray_on_loopback()
    import ray

    if ray.is_initialized():
        return False
    level = logging.ERROR if quiet else logging.WARNING
    if address is not None:
        # Attached loudly: Ray's own logging defaults.
        logs = {"configure_logging": True, "logging_level": level} if quiet else {}
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=not quiet, **logs)
        return True
    _Embedded.running, _Embedded.users = True, 0
    ray.init(
        address="local",  # a new Ray of our own, never one found via RAY_ADDRESS or /tmp/ray
        include_dashboard=False,
        num_cpus=max(4, num_lanes + 2),
        num_gpus=local_gpu_count() or num_lanes,  # logical GPUs without real ones
        namespace=NAMESPACE,
        log_to_driver=not quiet,
        configure_logging=True,
        logging_level=level,
    )
    return True


def take_embedded_ray() -> bool:
    """A pool of this process uses the embedded Ray: True when that Ray runs (the pool then
    holds a share of it, given back with :func:`embedded_ray_released`)."""
    import ray

    if not (_Embedded.running and ray.is_initialized()):
        return False
    _Embedded.users += 1
    return True


def embedded_ray_released() -> bool:
    """Give back a pool's share of the embedded Ray; the last share shuts it down. Whether
    it was the last."""
    import ray

    _Embedded.users = max(0, _Embedded.users - 1)
    if _Embedded.users or not _Embedded.running:
        return False
    _Embedded.running = False
    ray.shutdown()
    return True


@contextlib.contextmanager
def tool_ray(address: str | None, *, num_lanes: int) -> Iterator[None]:
    """Ray for a tool's whole run (``cpkv bench``, ``cpkv demo``): started quietly when this
    process has none (see :func:`ensure_ray`) and stopped at the end. The tool holds a share
    of an embedded Ray throughout, so the first of its pools to shut down does not stop it
    under the next (which would then start a fresh, loud one).
    """
    started = ensure_ray(address, num_lanes=num_lanes, quiet=True)
    held = started and address is None and take_embedded_ray()
    try:
        yield
    finally:
        if held:
            embedded_ray_released()  # the last share: stops it
        elif started:
            import ray

            ray.shutdown()
