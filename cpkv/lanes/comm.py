"""torch.distributed groups among the CP lanes of one pool, and the row collectives they use.

One :class:`LaneGroup` per lane process: rank ``r`` is lane ``r``. It rendezvouses through a
``TCPStore`` that rank 0 serves at ``host:port`` and initialises the process's default group on
that store. A lane that restarts forces the whole group to be rebuilt: every member calls
:meth:`LaneGroup.destroy` (idempotent) and then :meth:`LaneGroup.create` again with a fresh port,
in the same process. Each incarnation gets a ``generation`` id that rank 0 draws and every
member reads from the store, so members can check they joined the same group.

Backends (:func:`choose_backend`): ``cuda_ipc`` when every lane has a CUDA device and all are on
one node, packed on one GPU or not: the row collectives go through buffers the lanes share by
CUDA IPC (:class:`cpkv.lanes.ipc.IpcExchange`; no host copy), with a gloo group beside it for
barriers. NCCL for CUDA lanes on several nodes; gloo for CPU lanes, which stages CUDA tensors
through host memory. A ``cuda_ipc`` group whose lanes cannot map each other's memory (GPUs not
visible to each other, no peer access) agrees on a fallback when it is built: an NCCL group
when the lanes' GPUs differ, else gloo's staging.

Loopback: when ``host`` is a loopback address, rank 0's store listens on it only (torch's own
listener takes every interface), and ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` /
``TP_SOCKET_IFNAME`` are set to the loopback interface while the group lives (unless already
set), so the collectives' own sockets stay on this machine too; otherwise gloo would bind the
interface the hostname resolves to. On any other host they are left alone.

NOTE: every lane calls the same collectives in the same order with the same counts and dtypes
(the step plan is the same on every lane). ``cuda_ipc`` checks each exchange's op, element
type and sizes against its peers' and fails every lane on a mismatch; gloo and NCCL trust them
(gloo aborts the process on a size mismatch).
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpkv.core.backend import choose_backend
from cpkv.lanes.clock import StreamClock
from cpkv.lanes.ipc import ExchangeStats, IpcExchange, publish_setup_failure

__all__ = ["BACKENDS", "LaneGroup", "choose_backend", "free_port"]

logger = logging.getLogger("cpkv.comm")

#: Backends :meth:`LaneGroup.create` takes.
BACKENDS = ("gloo", "nccl", "cuda_ipc")

_GENERATION_KEY = "cpkv/lane_group/generation"
# TCPStore's libuv backend (the default) takes a listening socket from torch 2.8 on
# (pytorch/pytorch#150215); before, the store keeps its own listener on every interface.
_LISTEN_FD_WITH_LIBUV = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
# Probe sizes for measure(): a one-element gather for latency, ~1 MiB per rank for bandwidth.
_PROBE_SMALL_REPS = 8
_PROBE_LARGE_REPS = 3
_PROBE_LARGE_BYTES = 1 << 20


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close).

    Args:
        host: the address to bind.

    Returns:
        The port number. Another process may take it before it is used (rare on loopback).
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_ifname() -> str:
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"


def _set_loopback_ifnames() -> list[str]:
    """Point the collectives' socket interface variables that are unset at the loopback
    interface; the names set (to unset when the group goes)."""
    ifname = _loopback_ifname()
    names = [var for var in _IFNAME_VARS if var not in os.environ]
    for var in names:
        os.environ[var] = ifname
    return names


def _unset(names: list[str]) -> None:
    for var in names:
        os.environ.pop(var, None)


def _listen_fd(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, for rank 0's store (its own listener binds
    every interface, reachable from other machines through the host's outward address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def _as_list(counts: Sequence[int], world_size: int, what: str) -> list[int]:
    out = [int(c) for c in counts]
    if len(out) != world_size:
        raise ValueError(f"{what} has {len(out)} entries but world_size is {world_size}: {out}")
    if any(c < 0 for c in out):
        raise ValueError(f"{what} holds a negative count: {out}")
    return out


class LaneGroup:
    """A collective group among the ``world_size`` lanes of one pool (this process is ``rank``).

    Build with :meth:`create`. World size 1 needs no process group: the collectives return
    their input. Lanes that have nothing to send still call every collective.

    Attributes:
        rank: this lane.
        world_size: number of lanes.
        backend: ``"gloo"``, ``"nccl"``, ``"cuda_ipc"``, or ``"none"`` (world size 1). A
            ``cuda_ipc`` group that fell back says what it runs (``"nccl"`` or ``"gloo"``).
        generation: id of this incarnation, equal on every member.
        device: where the probe tensors of :meth:`measure` live (and NCCL's staging target).
        exchange: the device exchange of a ``cuda_ipc`` group, else ``None``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        generation: str,
        device: torch.device,
        store: dist.Store | None,
        exchange: IpcExchange | None = None,
        process_group: Any = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.generation = generation
        self.device = device
        self._store = store
        self._alive = True
        self._link: dict[str, float] | None = None
        self._wait = StreamClock()
        self.exchange = exchange
        self._pg = process_group  # None: the default group
        self._ifnames_set: list[str] = []  # the interface variables create set (unset later)

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        *,
        device: str | torch.device | None = None,
        exchange_device: Any = None,
    ) -> LaneGroup:
        """Join (rank 0: serve) the rendezvous at ``host:port`` and build the group.

        Every member calls this with the same ``world_size``, ``host``, ``port`` and
        ``backend``; it returns once all have joined.

        Args:
            rank: this lane, in ``[0, world_size)``.
            world_size: number of lanes.
            host: address of rank 0's store (``127.0.0.1`` for a single machine).
            port: the store's port (rank 0 binds it; use :func:`free_port`, a fresh one for
                every rebuild). Ignored for world size 1.
            backend: ``"gloo"``, ``"nccl"`` or ``"cuda_ipc"`` (see :func:`choose_backend`).
            timeout_s: rendezvous and collective timeout (also how long a ``cuda_ipc`` lane waits
                for a peer's exchange before failing the step).
            device: device of the probe tensors; default ``cuda`` (current) for NCCL and
                ``cuda_ipc``, else CPU.
            exchange_device: ``cuda_ipc`` only: the exchange's device adaptor (default
                :class:`~cpkv.lanes.ipc_device.CudaIpcDevice` on ``device``; tests pass
                :class:`~cpkv.lanes.ipc_device.FakeIpcDevice` to run it on CPU).

        Returns:
            The group.

        Raises:
            ValueError: bad rank / world size / backend / timeout.
            RuntimeError: this process already has a default process group (one lane group
                per process), or the rendezvous timed out.
        """
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if device is None:
            on_gpu = backend == "nccl" or (backend == "cuda_ipc" and exchange_device is None)
            device = torch.device("cuda") if on_gpu else torch.device("cpu")
        if exchange_device is not None:
            device = exchange_device.device
        device = torch.device(device)
        if world_size == 1:
            return cls(0, 1, "none", uuid.uuid4().hex, device, None)
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "this process already has a default torch.distributed group; destroy the "
                "previous LaneGroup (or the other user's group) first"
            )
        loopback = _is_loopback(host)
        ifnames_set = _set_loopback_ifnames() if loopback else []
        try:
            group = cls._create_group(
                rank, world_size, host, port, backend, timeout_s, device, exchange_device, loopback
            )
        except BaseException:
            _unset(ifnames_set)
            raise
        group._ifnames_set = ifnames_set
        return group

    @classmethod
    def _create_group(
        cls,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        backend: str,
        timeout_s: float,
        device: torch.device,
        exchange_device: Any,
        loopback: bool,
    ) -> LaneGroup:
        """:meth:`create` past its checks: the store, then the backend's group."""
        timeout = timedelta(seconds=timeout_s)
        own_listener = rank == 0 and loopback and _LISTEN_FD_WITH_LIBUV
        listen_fd = _listen_fd(host, int(port)) if own_listener else None
        store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=True,
            **({} if listen_fd is None else {"master_listen_fd": listen_fd}),
        )
        if rank == 0:
            store.set(_GENERATION_KEY, uuid.uuid4().hex)
        generation = store.get(_GENERATION_KEY).decode()
        if backend == "cuda_ipc":
            return cls._create_ipc(
                rank, world_size, store, generation, device, timeout_s, exchange_device
            )
        kwargs = {}
        if (
            backend == "nccl"
            and device.type == "cuda"
            and "device_id" in inspect.signature(dist.init_process_group).parameters
        ):
            kwargs["device_id"] = (
                device
                if device.index is not None
                else torch.device("cuda", torch.cuda.current_device())
            )
        _init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )
        return cls(rank, world_size, backend, generation, device, store)

    @classmethod
    def _create_ipc(
        cls,
        rank: int,
        world_size: int,
        store: dist.Store,
        generation: str,
        device: torch.device,
        timeout_s: float,
        adaptor: Any,
    ) -> LaneGroup:
        """The ``cuda_ipc`` group: gloo beside a device exchange, or the agreed fallback."""
        timeout = timedelta(seconds=timeout_s)
        _init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            return cls._build_ipc(rank, world_size, store, generation, device, timeout_s, adaptor)
        except BaseException:
            # NOTE: a failed create leaves the process as it found it (a peer that died
            # meanwhile fails the agreement): else no later group could start here.
            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    @classmethod
    def _build_ipc(
        cls,
        rank: int,
        world_size: int,
        store: dist.Store,
        generation: str,
        device: torch.device,
        timeout_s: float,
        adaptor: Any,
    ) -> LaneGroup:
        """:meth:`_create_ipc` past the gloo group's start; closes its exchange if it fails."""
        prefix = f"cpkv/ipc/{generation}"
        try:
            if adaptor is None:
                from cpkv.lanes.ipc_device import CudaIpcDevice

                adaptor = CudaIpcDevice(device)
            device = adaptor.device
            store.set(f"{prefix}/uuid/{rank}", adaptor.uuid())
        except Exception as e:  # the peers wait for this lane's handles: fail them at once
            publish_setup_failure(store, prefix, rank, e)
            raise
        exchange, why = None, ""
        try:
            exchange = IpcExchange(rank, world_size, store, prefix, adaptor, timeout_s)
        except Exception as e:  # any failure to map a peer: the group falls back
            why = f"{type(e).__name__}: {e}"
        try:
            # NOTE: every lane must take the same road, so they agree (the worst wins).
            ok = torch.tensor([1 if exchange is not None else 0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if int(ok) == 1:
                return cls(rank, world_size, "cuda_ipc", generation, device, store, exchange)
        except BaseException:
            if exchange is not None:
                exchange.close()
            raise
        if exchange is not None:
            exchange.close()
        uuids = [store.get(f"{prefix}/uuid/{r}").decode() for r in range(world_size)]
        distinct = device.type == "cuda" and len(set(uuids)) == world_size
        logger.warning(
            "lane %d: the lanes cannot share device memory (%s); falling back to %s",
            rank,
            why or "a peer could not",
            "an NCCL group" if distinct else "gloo through host memory",
        )
        if distinct:
            pg = dist.new_group(backend="nccl")
            return cls(rank, world_size, "nccl", generation, device, store, None, pg)
        return cls(rank, world_size, "gloo", generation, device, store)

    @property
    def alive(self) -> bool:
        """False once :meth:`destroy` ran."""
        return self._alive

    @property
    def device_stuck(self) -> bool:
        """True once :meth:`destroy` found this lane's device work still waiting on a dead
        peer (CUDA IPC): the stream never drains, only a new process frees the device."""
        return self.exchange is not None and self.exchange.stuck

    def destroy(self) -> None:
        """Tear the group down (idempotent); the process can then :meth:`create` a new one,
        even when closing the exchange failed."""
        if not self._alive:
            return
        self._alive = False
        try:
            if self.exchange is not None:
                self.exchange.close()
        finally:
            if self.world_size > 1 and dist.is_initialized():
                dist.destroy_process_group()
            self._store = None  # rank 0's store server closes with the last reference
            _unset(self._ifnames_set)
            self._ifnames_set = []

    def __enter__(self) -> LaneGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return (
            f"LaneGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"generation={self.generation[:8]!r}, alive={self._alive})"
        )

    # --- collectives ---

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError(f"{self!r} was destroyed; create a new group")

    def _comm_device(self, t: torch.Tensor) -> torch.device:
        """Where ``t`` must be for the backend: gloo needs host memory, NCCL the lane's GPU."""
        if self.backend == "gloo":
            return torch.device("cpu")
        if self.backend == "nccl" and t.device.type != "cuda":
            return self.device
        return t.device

    def barrier(self) -> None:
        """Wait for every member (no-op at world size 1)."""
        self._check_alive()
        if self.world_size > 1:
            dist.barrier(group=self._pg)

    def all_gather_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Gather a variable number of rows from every lane, rank-major.

        Args:
            x: ``[counts[rank], ...]`` this lane's rows; the trailing shape and dtype are the
                same on every lane.
            counts: rows of every lane (known to all, e.g. from the step plan; no metadata
                travels).

        Returns:
            ``[sum(counts), ...]``: lane 0's rows, then lane 1's, ..., on ``x``'s device.

        Raises:
            ValueError: ``counts`` of the wrong length, negative, or not matching ``x``.
        """
        self._check_alive()
        counts = _as_list(counts, self.world_size, "counts")
        if x.shape[0] != counts[self.rank]:
            raise ValueError(
                f"all_gather_rows: x has {x.shape[0]} rows but counts[{self.rank}]="
                f"{counts[self.rank]}"
            )
        if self.world_size == 1:
            return x
        top = max(counts)
        if top == 0:  # every lane knows counts: all skip together
            return x.new_empty((0, *x.shape[1:]))
        if self.exchange is not None:
            with self._wait.timed(x.device):
                return self.exchange.all_gather_rows(x, counts)
        with self._wait.timed(x.device):
            where = self._comm_device(x)
            buf = x.new_zeros((top, *x.shape[1:]), device=where)
            buf[: x.shape[0]] = x
            out = buf.new_empty((self.world_size * top, *x.shape[1:]))
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, buf, group=self._pg)
            out = out.view(self.world_size, top, *x.shape[1:])
            if all(c == top for c in counts):
                rows = out.reshape(-1, *x.shape[1:])
            else:
                rows = torch.cat([out[r, : counts[r]] for r in range(self.world_size)])
            return rows.to(x.device)

    def all_to_all_rows(
        self, send: Sequence[torch.Tensor], recv_counts: Sequence[int]
    ) -> list[torch.Tensor]:
        """Send ``send[r]`` to lane ``r`` and receive each lane's rows for this one.

        Args:
            send: ``world_size`` tensors ``[n_r, ...]`` (same trailing shape and dtype, one
                device).
            recv_counts: rows this lane receives from each lane.

        Returns:
            ``world_size`` tensors ``[recv_counts[r], ...]`` (from lane ``r``), on the send
            tensors' device.

        Raises:
            ValueError: wrong number of tensors or counts, mismatched trailing shapes or dtypes.
        """
        self._check_alive()
        if len(send) != self.world_size:
            raise ValueError(
                f"all_to_all_rows: {len(send)} send tensors for world_size={self.world_size}"
            )
        recv_counts = _as_list(recv_counts, self.world_size, "recv_counts")
        tail = tuple(send[0].shape[1:])
        if any(tuple(s.shape[1:]) != tail for s in send):
            raise ValueError(
                f"all_to_all_rows: send shapes differ: {[tuple(s.shape) for s in send]}"
            )
        # NOTE: checked here, before any collective: the device exchange copies raw bytes.
        if any(s.dtype != send[0].dtype for s in send):
            raise ValueError(f"all_to_all_rows: send dtypes differ: {[s.dtype for s in send]}")
        if self.world_size == 1:
            if send[0].shape[0] != recv_counts[0]:
                raise ValueError(
                    f"all_to_all_rows: sending {send[0].shape[0]} rows to self but expecting "
                    f"{recv_counts[0]}"
                )
            return [send[0]]
        device = send[0].device
        if self.exchange is not None:
            with self._wait.timed(device):
                return self.exchange.all_to_all_rows(send, recv_counts)
        with self._wait.timed(device):
            where = self._comm_device(send[0])
            flat_in = torch.cat([s.to(where) for s in send]).contiguous()
            out = flat_in.new_empty((sum(recv_counts), *tail))
            dist.all_to_all_single(
                out,
                flat_in,
                output_split_sizes=recv_counts,
                input_split_sizes=[int(s.shape[0]) for s in send],
                group=self._pg,
            )
            return list(out.to(device).split(recv_counts))

    def take_exchange_stats(self) -> ExchangeStats:
        """What the device exchange moved since the last call (then reset); zeros for the
        other backends."""
        return ExchangeStats() if self.exchange is None else self.exchange.take_stats()

    def take_wait_seconds(self) -> float:
        """Seconds this lane spent in row collectives since the last call (then reset).

        Step time minus this is the lane's own work: the number that shows how evenly a plan
        splits the work, which a step's wall time (everyone waits for the slowest) hides.
        """
        return self._wait.take()

    # --- link probe ---

    def measure(self) -> dict[str, float]:
        """Latency and bandwidth of this group's all-gather, measured once and cached.

        A collective: every member calls it at the same point (the first ``auto`` attention
        does). Each member times a one-element gather (latency) and a ~1 MiB-per-rank gather
        (bytes received per second per lane); the members then share their numbers and all
        take the worst (largest latency, smallest bandwidth), so every lane holds the same
        values and makes the same decisions from them.

        Returns:
            ``{"latency_s": float, "bytes_per_s": float}``; at world size 1 ``0`` and ``inf``.
        """
        self._check_alive()
        if self._link is not None:
            return dict(self._link)
        if self.world_size == 1:
            self._link = {"latency_s": 0.0, "bytes_per_s": float("inf")}
            return dict(self._link)
        ws = self.world_size

        def timed(x: torch.Tensor, reps: int) -> float:
            self.all_gather_rows(x, [x.shape[0]] * ws)  # warm-up (connections, allocators)
            self._sync()
            start = time.perf_counter()
            for _ in range(reps):
                self.all_gather_rows(x, [x.shape[0]] * ws)
            self._sync()
            return (time.perf_counter() - start) / reps

        small = torch.zeros(1, 1, dtype=torch.float32, device=self.device)
        latency = timed(small, _PROBE_SMALL_REPS)
        large = torch.zeros(_PROBE_LARGE_BYTES // 4 // 256, 256, device=self.device)
        t_large = timed(large, _PROBE_LARGE_REPS)
        received = (ws - 1) * large.numel() * 4
        bandwidth = received / max(t_large - latency, 1e-9)
        mine = torch.tensor([[latency, bandwidth]], dtype=torch.float64, device=self.device)
        everyone = self.all_gather_rows(mine, [1] * ws).cpu()
        self._link = {
            "latency_s": float(everyone[:, 0].max()),
            "bytes_per_s": float(everyone[:, 1].min()),
        }
        return dict(self._link)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _init_process_group(backend: str, **kwargs: Any) -> None:
    """``dist.init_process_group``, leaving the process as it found it when that fails.

    NOTE: every init counts up torch's group counter, which names the rendezvous keys, and
    only ``destroy_process_group`` sets it back: after an init that failed (a peer died in
    the rendezvous) nothing is there to destroy, and this process would wait on other keys
    than a restarted peer's at every later group (measured: each timed out).
    """
    try:
        dist.init_process_group(backend, **kwargs)
    except BaseException:
        if not dist.is_initialized():
            from torch.distributed import distributed_c10d

            world = getattr(distributed_c10d, "_world", None)
            if world is not None and hasattr(world, "group_count"):
                world.group_count = 0
        raise
