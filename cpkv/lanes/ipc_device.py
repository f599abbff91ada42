"""The device side of a device exchange: CUDA IPC buffers and interprocess events, and a CPU
stand-in with the same interface so the protocol runs (and is checked) without a GPU.

An *adaptor* gives :class:`cpkv.lanes.ipc.IpcExchange` what it needs from a device:

* ``alloc(nbytes)`` a ``uint8`` buffer, ``export(buf)`` a JSON-able description of it and
  ``open(desc)`` the peer's view of it;
* ``new_event()``, ``export_event(ev)``, ``open_event(desc)``, ``record(ev, tag)`` and
  ``wait(ev, tag)`` (the current stream waits; ``tag`` is the exchange whose record is meant,
  which only the stand-in can check);
* ``unblock(ev)`` completes a dead peer's event from this side, so waits this lane queued on it
  end (a process that dies takes its queued records with it);
* ``retire(mapping)`` drops a peer mapping once this lane's reads of it are done, ``collect()``
  drops the retired ones that are done, ``release(buf)`` an own buffer the peers no longer read,
  and ``quiesce()`` whether everything this lane queued is finished (before a teardown).

:class:`CudaIpcDevice` shares whole storages with ``_share_cuda_`` / ``_new_shared_cuda`` (as
``torch.multiprocessing`` does, with its reference counts: an exporter's block stays allocated
until every importer dropped its mapping) and events with ``torch.cuda.Event(interprocess=True)``.
:class:`FakeIpcDevice` keeps buffers and events in files under ``/dev/shm``; CPU copies are
synchronous, so an event "completes" when recorded and a wait checks that the record it sees is
the one the protocol meant (a stale or early record raises :class:`EventOrderError`).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import numpy as np
import torch

from cpkv.lanes.ipc_board import board_path

__all__ = ["CudaIpcDevice", "EventOrderError", "FakeIpcDevice"]


class EventOrderError(AssertionError):
    """(stand-in device) A wait saw another record than the protocol meant."""


class CudaIpcDevice:
    """CUDA IPC on ``device`` (this lane's GPU; peers' buffers are mapped on it too)."""

    __slots__ = ("_retired", "_side", "device")

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._retired: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        # NOTE: made now: creating a stream once a stream is stuck on a dead peer's event
        # blocks for good (measured on the H200: docs/gpu-run/ipc/dying.txt).
        self._side = torch.cuda.Stream(device)

    def uuid(self) -> str:
        return str(torch.cuda.get_device_properties(self.device).uuid)

    # --- buffers ---

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def export(self, buf: torch.Tensor) -> dict:
        (_, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync) = (
            buf.untyped_storage()._share_cuda_()
        )
        return {
            "handle": handle.hex(),
            "size": int(size),
            "offset": int(offset),
            "ref_handle": ref_handle.hex(),
            "ref_offset": int(ref_offset),
            "event": None if ev_handle is None else ev_handle.hex(),
            "event_sync": bool(ev_sync),
        }

    def open(self, desc: dict) -> torch.Tensor:
        with torch.cuda.device(self.device):
            storage = torch.UntypedStorage._new_shared_cuda(
                self.device.index,
                bytes.fromhex(desc["handle"]),
                desc["size"],
                desc["offset"],
                bytes.fromhex(desc["ref_handle"]),
                desc["ref_offset"],
                None if desc["event"] is None else bytes.fromhex(desc["event"]),
                desc["event_sync"],
            )
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        return torch._utils._rebuild_tensor(typed, 0, (desc["size"],), (1,))

    def release(self, buf: torch.Tensor) -> None:
        """Nothing to do: the block stays allocated while any peer still maps it (the shared
        reference count); this lane only drops its reference."""

    def retire(self, mapping: torch.Tensor) -> None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._retired.append((mapping, done))

    def collect(self) -> None:
        self._retired = [(m, e) for m, e in self._retired if not e.query()]

    # --- events ---

    def new_event(self) -> torch.cuda.Event:
        with torch.cuda.device(self.device):
            ev = torch.cuda.Event(interprocess=True)
            ev.record(torch.cuda.current_stream(self.device))  # created on this device
        return ev

    def export_event(self, ev: torch.cuda.Event) -> str:
        with torch.cuda.device(self.device):
            return bytes(ev.ipc_handle()).hex()

    def open_event(self, desc: str) -> torch.cuda.Event:
        return torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(desc))

    def record(self, ev: torch.cuda.Event, tag: int) -> None:
        ev.record(torch.cuda.current_stream(self.device))

    def wait(self, ev: torch.cuda.Event, tag: int) -> None:
        ev.wait(torch.cuda.current_stream(self.device))

    def unblock(self, ev: torch.cuda.Event) -> None:
        # A record from this process on a stream that waits for nothing: once it completes, the
        # event's waits queued earlier (for the dead peer's record) are satisfied.
        ev.record(self._side)

    def quiesce(self, grace_s: float = 0.0) -> bool:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        # NOTE: no synchronize: a stream stuck on a dead peer's event would hang the teardown.
        deadline = time.perf_counter() + grace_s
        while not done.query():
            if time.perf_counter() >= deadline:
                return False
            time.sleep(0.005)
        return True


class FakeIpcDevice:
    """A CPU stand-in for :class:`CudaIpcDevice` (tests; every lane of a group uses one).

    Buffers are ``/dev/shm`` files mapped as ``uint8`` CPU tensors; an event is one int64 in a
    file holding the tag of its last record.

    Args:
        name: put in every file's name (``cpkv-fake-{name}-...``), so a test can find and remove
            the files of a lane that died without :meth:`close`.
    """

    __slots__ = ("_files", "device", "name", "records", "waits")

    def __init__(self, name: str = "") -> None:
        if "/" in name:
            raise ValueError(f"name must be a file name part (no '/'), got {name!r}")
        self.device = torch.device("cpu")
        self.name = name
        self._files: list[str] = []
        self.records: list[tuple[str, int]] = []  # (event name, tag), in order: for tests
        self.waits: list[tuple[str, int]] = []

    def uuid(self) -> str:
        return "fake-cpu"

    def _file(self, nbytes: int) -> str:
        stem = f"{self.name}-{uuid.uuid4().hex}" if self.name else uuid.uuid4().hex
        path = os.path.join(os.path.dirname(board_path("")), f"cpkv-fake-{stem}")
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 8))
        self._files.append(path)
        return path

    @staticmethod
    def _map(path: str, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
        return np.memmap(path, dtype=dtype, mode="r+", shape=(nbytes // np.dtype(dtype).itemsize,))

    def alloc(self, nbytes: int) -> torch.Tensor:
        path = self._file(nbytes)
        buf = torch.from_numpy(self._map(path, nbytes))
        buf.fake_path = path  # type: ignore[attr-defined]
        return buf

    def export(self, buf: torch.Tensor) -> dict:
        return {"path": buf.fake_path, "size": int(buf.numel())}  # type: ignore[attr-defined]

    def open(self, desc: dict) -> torch.Tensor:
        return torch.from_numpy(self._map(desc["path"], desc["size"]))

    def release(self, buf: torch.Tensor) -> None:
        path = buf.fake_path  # type: ignore[attr-defined]
        if path in self._files:
            self._files.remove(path)
            os.unlink(path)  # the peers keep their mappings

    def retire(self, mapping: torch.Tensor) -> None:
        """CPU reads are done when issued: nothing to keep."""

    def collect(self) -> None:
        pass

    def new_event(self) -> np.ndarray:
        path = self._file(8)
        ev = self._map(path, 8, np.int64)
        ev[0] = -1  # never recorded
        return ev

    def export_event(self, ev: np.ndarray) -> str:
        return ev.filename

    def open_event(self, desc: str) -> np.ndarray:
        return self._map(desc, 8, np.int64)

    def record(self, ev: np.ndarray, tag: int) -> None:
        ev[0] = tag
        self.records.append((os.path.basename(ev.filename), tag))

    def wait(self, ev: np.ndarray, tag: int) -> None:
        seen = int(ev[0])
        self.waits.append((os.path.basename(ev.filename), tag))
        if seen != tag:
            raise EventOrderError(
                f"waited on the record of exchange {tag} of {os.path.basename(ev.filename)} "
                f"but its last record is of exchange {seen}"
            )

    def unblock(self, ev: np.ndarray) -> None:
        """CPU waits never block: nothing to release."""

    def quiesce(self, grace_s: float = 0.0) -> bool:
        return True

    def close(self) -> None:
        """Remove this lane's files (its peers keep what they mapped)."""
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._files = []
