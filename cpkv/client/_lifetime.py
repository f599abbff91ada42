"""A client's lifetime at its pool: its lease renewed while it lives, and what a client
dropped without ``shutdown()`` leaves (its lease closed, the pool it created stopped)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from cpkv.actors.pool import Pool

if TYPE_CHECKING:
    from cpkv.client._client import CPKVClient

__all__ = ["LeaseKeeper", "drop_pool", "weakly"]

logger = logging.getLogger("cpkv.client")

_T = TypeVar("_T")


class LeaseKeeper:
    """Renews a client's lease every third of it, while the client lives.

    Holds the client weakly: a client that is garbage-collected (dropped without
    :meth:`CPKVClient.shutdown`) has its lease closed, its requests freed, as shutdown does.
    NOTE: not left to lapse: its process may live on (a pooled Ray worker), and the
    coordinator keeps the lease of a live process's client whose renewals stopped.
    """

    def __init__(self, client: CPKVClient, lease_s: float) -> None:
        self._client = weakref.ref(client)
        self._coord = client._coord
        self._client_id = client.client_id
        self._hello_args = client._hello_args
        self._lease_s = lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpkv-lease")
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self._lease_s / 3):
            if self._client() is None:
                try:
                    ray.get(self._coord.close_lease.remote(self._client_id), timeout=self._lease_s)
                except Exception:  # the pool went with it (its creator), or is restarting
                    logger.debug("closing a dropped client's lease failed", exc_info=True)
                return
            try:
                renewed = ray.get(
                    self._coord.renew_lease.remote(self._client_id), timeout=self._lease_s
                )
                if not renewed and not self._stop.is_set():  # (closed by shutdown meanwhile)
                    # Lapsed (or a new coordinator): open the lease again. NOTE: the lapse
                    # stays remembered; the client's next call is told what was freed.
                    ray.get(self._coord.hello.remote(*self._hello_args), timeout=self._lease_s)
            except Exception:  # coordinator restarting or gone: try again next period
                logger.debug("lease renewal failed", exc_info=True)

    def stop(self) -> None:
        """Renew no more (the thread ends within a third of the lease)."""
        self._stop.set()


def weakly(method: Callable[..., _T]) -> Callable[..., _T]:
    """A bound method called through a weak reference to its object: a part the client owns
    holds no reference back to it, so a dropped client is freed at once (and its lease stops
    being renewed: see :class:`LeaseKeeper`)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def drop_pool(pool: Pool) -> None:
    """What a dropped client leaves: the pool it created stopped (unless detached), its
    share of the local Ray given back."""
    try:
        if pool.created and not pool.detached:
            pool.stop()
        pool.release_ray()
    except Exception:  # a finalizer never raises
        logger.debug("dropping a client's pool failed", exc_info=True)
