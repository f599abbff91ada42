"""The device exchange's bookkeeping on CPU: buffer sizing and growth, handle exchange, event
order, the host board, rebuild after a restart, a dead peer, and the fallback.

The multi-lane tests spawn lanes (torch.multiprocessing, no Ray) that build ``cuda_ipc`` lane
groups on :class:`cpkv.lanes.ipc_device.FakeIpcDevice`: buffers and events are ``/dev/shm``
files, and every wait checks that it sees exactly the record the protocol meant (the exchange
that recorded it), so an ordering bug raises instead of passing by luck. Results are checked
against what each lane's rows must be (deterministic functions of lane and exchange), not
against the exchange itself. With a GPU the same groups run on CUDA IPC in
``tests/test_cp_attention.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import glob
import itertools
import json
import os
import threading
import time
import traceback
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpkv.lanes.comm import LaneGroup, free_port
from cpkv.lanes.ipc_board import Board, BoardLayout, PeerGoneError, board_path
from cpkv.lanes.ipc_book import (
    ALIGN,
    GROW_QUANTUM,
    SlotBook,
    aligned,
    grown_capacity,
    to_all_layout,
)
from cpkv.lanes.ipc_device import CudaIpcDevice, EventOrderError, FakeIpcDevice

TIMEOUT_S = 30.0
SHM = os.path.dirname(board_path("x"))


def remove_fake_files(name: str) -> list[str]:
    """Remove the stand-in files of :class:`FakeIpcDevice` ``(name)``s; their names."""
    paths = sorted(glob.glob(os.path.join(SHM, f"cpkv-fake-{name}-*")))
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return paths


# --- bookkeeping without processes ---


def test_grown_capacity_doubles_and_rounds() -> None:
    assert grown_capacity(0, 0) == 0 and grown_capacity(1, 0) == GROW_QUANTUM
    assert grown_capacity(10, GROW_QUANTUM) == GROW_QUANTUM  # fits: unchanged
    assert grown_capacity(GROW_QUANTUM + 1, GROW_QUANTUM) == 2 * GROW_QUANTUM
    assert grown_capacity(5 * GROW_QUANTUM + 1, GROW_QUANTUM) == 6 * GROW_QUANTUM
    assert grown_capacity(3 * GROW_QUANTUM, 2 * GROW_QUANTUM) == 4 * GROW_QUANTUM  # doubling
    with pytest.raises(ValueError, match=">= 0"):
        grown_capacity(-1, 0)


def test_slot_book_turns_alternate_slots_and_wait_two_back() -> None:
    book = SlotBook(minimum=1024, initial=100)
    assert (book.capacity, book.version) == (GROW_QUANTUM, 1)
    turns = [book.begin(10) for _ in range(5)]
    assert [t.seq for t in turns] == [1, 2, 3, 4, 5]
    assert [t.slot for t in turns] == [1, 0, 1, 0, 1]
    # A slot is rewritten only after every peer's consumed record of two exchanges back.
    assert [t.wait_consumed_tag for t in turns] == [None, None, 1, 2, 3]
    assert all(t.grow_to is None and t.version == 1 for t in turns)
    grow = book.begin(GROW_QUANTUM + 1)
    assert grow.grow_to == 2 * GROW_QUANTUM and grow.version == 2 and grow.seq == 6
    assert grow.offset(book.capacity) == 0 and book.begin(1).offset(book.capacity) == book.capacity
    assert book.begin(2 * GROW_QUANTUM).grow_to is None  # fits now


def test_to_all_layout_aligns_parts_and_skips_self() -> None:
    starts, lengths, total = to_all_layout([10, 300, 7, 0], rank=1)
    assert lengths == [10, 0, 7, 0]
    assert starts == [0, 0, ALIGN, 2 * ALIGN]
    assert total == 2 * ALIGN and all(s % ALIGN == 0 for s in starts)
    assert aligned(0) == 0 and aligned(1) == ALIGN and aligned(ALIGN) == ALIGN
    with pytest.raises(ValueError, match="negative"):
        to_all_layout([1, -1], 0)


def test_board_layout_is_line_aligned() -> None:
    for ws in (2, 3, 4, 8):
        lay = BoardLayout(ws)
        assert lay.record_words % 8 == 0 and lay.record_words >= 3 + 2 * lay.slot_words
        assert lay.nbytes == ws * lay.record_words * 8


def test_board_post_and_wait(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    b0 = Board(path, 2, 0, create=True)
    b1 = Board(path, 2, 1)
    b1.post(1, 2, 3, [0, 256], [100, 0])
    b0.wait_posted(1, 1, 1.0)
    assert b0.slot(1, 1, 0) == (2, 3, 0, 100)
    assert b0.pid(1) == os.getpid()
    t0 = time.perf_counter()
    with pytest.raises(PeerGoneError, match="did not post exchange 2 within"):
        b0.wait_posted(1, 2, 0.2)
    assert time.perf_counter() - t0 < 2.0
    b1.leave()  # posted stays readable; what it never posted fails at once
    b0.wait_posted(1, 1, 1.0)
    with pytest.raises(PeerGoneError, match="left the group before posting exchange 2"):
        b0.wait_posted(1, 2, 60.0)
    b1.unlink()
    b1.close()
    b0.close()


def test_board_sees_a_dead_peer_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "board")
    b0 = Board(path, 2, 0, create=True)
    proc = mp.get_context("spawn").Process(target=_open_board_and_exit, args=(path,))
    proc.start()
    proc.join()
    t0 = time.perf_counter()
    with pytest.raises(PeerGoneError, match="died before posting exchange 1"):
        b0.wait_posted(1, 1, 60.0)
    assert time.perf_counter() - t0 < 2.0  # the liveness check, not the timeout
    b0.close()


def _open_board_and_exit(path: str) -> None:
    Board(path, 2, 1)


def test_fake_event_rejects_a_stale_record() -> None:
    dev = FakeIpcDevice()
    ev = dev.new_event()
    dev.record(ev, 3)
    dev.wait(ev, 3)
    with pytest.raises(EventOrderError, match="exchange 4"):
        dev.wait(ev, 4)
    dev.close()


# --- lanes in processes ---


def rows_of(lane: int, step: int, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """What lane ``lane`` sends in exchange ``step``: ``[n, width]``, distinct everywhere."""
    base = (lane * 1000 + step) * 100000
    return (torch.arange(n * width, dtype=torch.float64) + base).reshape(n, width).to(dtype)


def counts_of(step: int, ws: int) -> list[int]:
    """Rows per lane in exchange ``step``: some zero, one step large enough to regrow."""
    if step == 5:
        return [70000 + 13 * r for r in range(ws)]  # > 1 MiB at width 4 fp32: growth
    rng = np.random.default_rng(step)
    return [int(c) for c in rng.integers(0, 9, ws)]


def run_exchanges(group: LaneGroup, steps: int) -> list[str]:
    """Alternate all-gathers and all-to-alls of known rows; the mismatches seen."""
    ws, me = group.world_size, group.rank
    errors = []
    for step in range(steps):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[step % 3]
        width = 4 if step % 3 != 2 else 3
        counts = counts_of(step, ws)
        x = rows_of(me, step, counts[me], width, dtype).to(group.device)
        got = group.all_gather_rows(x, counts).cpu()
        want = torch.cat([rows_of(r, step, counts[r], width, dtype) for r in range(ws)])
        if not torch.equal(got, want):
            errors.append(f"gather {step}: differs")

        # all-to-all: lane r sends (r + q + step) % 5 rows to lane q.
        def n(r: int, q: int, step: int = step) -> int:
            return 70000 if step == 7 and r != q else (r + q + step) % 5

        send = [rows_of(me * 10 + q, step, n(me, q), width, dtype) for q in range(ws)]
        recv = group.all_to_all_rows(
            [t.to(group.device) for t in send], [n(r, me) for r in range(ws)]
        )
        for r in range(ws):
            if not torch.equal(recv[r].cpu(), rows_of(r * 10 + me, step, n(r, me), width, dtype)):
                errors.append(f"all-to-all {step}: from lane {r} differs")
    return errors


class StuckAfterDeath(FakeIpcDevice):
    """A stand-in whose queued work never drains (as a CUDA stream waiting on a dead peer)."""

    __slots__ = ()

    def quiesce(self, grace_s: float = 0.0) -> bool:
        return False


class FailingOpen(FakeIpcDevice):
    """A stand-in whose peer mappings fail (as another GPU not visible to this process)."""

    __slots__ = ()

    def open(self, desc: dict) -> torch.Tensor:
        raise RuntimeError("cannot map this peer")


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def listeners(port: int) -> list[list[str]]:
    """``[family, hex address]`` of the sockets listening on ``port`` (from /proc)."""
    found = []
    for family in ("tcp", "tcp6"):
        with open(f"/proc/net/{family}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append([family, address])
    return found


def lane_main(rank: int, ws: int, ports: list[int], out_dir: str, kind: str, name: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda:0" if kind == "cuda" else "cpu")

    def adaptor() -> FakeIpcDevice | None:
        return FakeIpcDevice(name) if kind == "fake" else None  # None: CUDA IPC on device

    report: dict = {"rank": rank, "fatal": None, "phases": []}
    try:
        # Phase 0 and 1: the same processes build a group, use it, destroy it, build again
        # (what a lane restart forces), on fresh handles.
        for phase in range(2):
            dev = adaptor()
            ifnames_before = sorted(v for v in IFNAME_VARS if v in os.environ)
            group = LaneGroup.create(
                rank,
                ws,
                "127.0.0.1",
                ports[phase],
                "cuda_ipc",
                TIMEOUT_S,
                device=device,
                exchange_device=dev,
            )
            errors = run_exchanges(group, 9)
            stats = group.take_exchange_stats()
            link = group.measure()
            listening = listeners(ports[phase]) if rank == 0 else None
            mismatch = None
            if phase == 1:  # lane 0 sends float32, the others as many bytes of int32
                dtype = torch.float32 if rank == 0 else torch.int32
                try:
                    group.all_gather_rows(torch.ones(2, 3, dtype=dtype, device=device), [2] * ws)
                    mismatch = "no error"
                except RuntimeError as e:
                    mismatch = str(e)
            group.destroy()
            group.destroy()
            report["phases"].append(
                {
                    "listening": listening,
                    "mismatch": mismatch,
                    "ifnames": [ifnames_before, sorted(v for v in IFNAME_VARS if v in os.environ)],
                    "store_dropped": group.exchange._store is None,
                    "backend": group.backend,
                    "generation": group.generation,
                    "errors": errors,
                    "exchanges": stats.exchanges,
                    "bytes_read": stats.bytes_read,
                    "regrowths": stats.regrowths,
                    "records": len(dev.records) if dev else None,
                    "waits": len(dev.waits) if dev else None,
                    "link": link,
                }
            )
        # Phase 2: lane 1 cannot map its peers: every lane falls back to gloo together.
        dev = FailingOpen(name) if rank == 1 else FakeIpcDevice(name)
        group = LaneGroup.create(
            rank, ws, "127.0.0.1", ports[2], "cuda_ipc", TIMEOUT_S, exchange_device=dev
        )
        report["phases"].append(
            {"backend": group.backend, "errors": run_exchanges(group, 4), "exchanges": 0}
        )
        group.destroy()
        # Phase 3: the last lane dies after 2 exchanges; the others fail the third fast.
        group = LaneGroup.create(
            rank,
            ws,
            "127.0.0.1",
            ports[3],
            "cuda_ipc",
            TIMEOUT_S,
            device=device,
            exchange_device=StuckAfterDeath(name) if kind == "fake" else None,
        )
        ones = torch.ones(2, 3, device=device)
        for _ in range(2):
            group.all_gather_rows(ones, [2] * ws)
        if rank == ws - 1:
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
            os._exit(0)  # no teardown, as a killed lane
        t0 = time.perf_counter()
        try:
            group.all_gather_rows(ones, [2] * ws)
            report["dead_peer"] = "no error"
        except PeerGoneError as e:
            report["dead_peer"] = str(e)
        report["dead_peer_s"] = time.perf_counter() - t0
        report["stuck_before"] = group.device_stuck
        group.destroy()
        report["stuck_after"] = group.device_stuck
    except Exception:
        report["fatal"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


WS = 3
# The stand-in everywhere; CUDA IPC too where there is a GPU (lanes packed on it).
KINDS = ["fake"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=KINDS)
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("ipc")
    ports = [free_port() for _ in range(4)]
    name = uuid.uuid4().hex
    before = set(os.listdir(SHM))
    try:
        mp.spawn(lane_main, args=(WS, ports, str(out), request.param, name), nprocs=WS, join=True)
    finally:
        # The killed lane's stand-in files (a real GPU frees its buffers with the process).
        remove_fake_files(name)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WS)]
    fatal = [r["fatal"] for r in reports if r["fatal"]]
    assert not fatal, "\n".join(fatal)
    new = set(os.listdir(SHM)) - before
    reports[0]["left_behind"] = sorted(f for f in new if f.startswith("cpkv-board-"))
    return reports


def test_exchanges_deliver_every_lanes_rows(reports: list[dict]) -> None:
    for phase in (0, 1):
        lanes = [r["phases"][phase] for r in reports]
        assert all(p["backend"] == "cuda_ipc" for p in lanes)
        assert all(p["errors"] == [] for p in lanes), [p["errors"] for p in lanes]
        # 9 gathers + 9 all-to-alls; the 1 MiB first slot grows for exchanges 11 and 15 (the
        # large gather and all-to-all), at least once per lane.
        assert all(p["exchanges"] == 18 for p in lanes)
        assert all(p["regrowths"] >= 1 for p in lanes)
        assert all(p["bytes_read"] > 0 for p in lanes)
        # Every exchange records written + consumed; the fake checked every wait's tag.
        if lanes[0]["records"] is not None:
            assert all(p["records"] >= 2 * 18 for p in lanes)
            assert all(p["waits"] > 0 for p in lanes)
        assert all(p["link"]["bytes_per_s"] > 0 for p in lanes)
        assert len({p["generation"] for p in lanes}) == 1


def test_a_loopback_group_stays_on_loopback_and_leaves_no_trace(reports: list[dict]) -> None:
    """Rank 0's store listened on every interface (torch's own listener); the interface
    variables set for the group stayed set for the process's later groups on other hosts;
    a destroyed group kept rank 0's store server alive through its exchange."""
    assert reports[0]["phases"][0]["listening"] == [["tcp", "0100007F"]]  # 127.0.0.1 only
    for r in reports:
        for phase in r["phases"][:2]:
            assert phase["ifnames"][0] == phase["ifnames"][1], phase["ifnames"]
            assert phase["store_dropped"]


def test_lanes_exchanging_different_dtypes_fail_together(reports: list[dict]) -> None:
    """As many bytes of float32 and of int32 were read as each other's bits."""
    for r in reports:
        got = r["phases"][1]["mismatch"]
        assert "all_gather_rows of float32" in got and "all_gather_rows of int32" in got, got


def test_a_destroy_whose_exchange_fails_to_close_still_frees_the_process() -> None:
    """The default group was left up (the group marked dead first): no later group could
    start in this process, the lane never rejoined."""

    class FailingClose:
        stuck = False

        def close(self) -> None:
            raise RuntimeError("device query failed")

    store = dist.TCPStore(
        "127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = LaneGroup(0, 2, "cuda_ipc", "g", torch.device("cpu"), store, FailingClose())
    with pytest.raises(RuntimeError, match="device query failed"):
        group.destroy()
    assert not dist.is_initialized() and not group.alive


def test_rebuild_uses_a_new_generation(reports: list[dict]) -> None:
    assert reports[0]["phases"][0]["generation"] != reports[0]["phases"][1]["generation"]


def test_a_lane_that_cannot_map_makes_all_fall_back(reports: list[dict]) -> None:
    lanes = [r["phases"][2] for r in reports]
    assert [p["backend"] for p in lanes] == ["gloo"] * WS
    assert all(p["errors"] == [] for p in lanes)


def test_a_dead_peer_fails_the_exchange_fast(reports: list[dict]) -> None:
    for r in reports[:-1]:
        assert "died before posting exchange 3" in r["dead_peer"], r["dead_peer"]
        assert r["dead_peer_s"] < 5.0, r["dead_peer_s"]  # the timeout is 30 s
        if r["phases"] and r["phases"][0]["records"] is not None:  # the stand-in: never drains
            assert (r["stuck_before"], r["stuck_after"]) == (False, True)


def test_no_board_left_behind(reports: list[dict]) -> None:
    assert reports[0]["left_behind"] == []


# --- CUDA: a peer that dies with its write still queued on the GPU ---


def dying_main(rank: int, port: int, out_dir: str) -> None:
    """Lane 1 queues a long kernel before its write, posts, and exits at once; lane 0's stream
    then waits on a record that will never complete on the GPU. Lane 0's next exchange finds
    lane 1 dead, completes its events from this side and fails; lane 0's stream must then
    drain (not stay stuck) and its group come down at once."""
    report: dict = {"rank": rank}
    group = LaneGroup.create(rank, 2, "127.0.0.1", port, "cuda_ipc", 20.0, device="cuda:0")
    x = torch.ones(4, 8, device="cuda:0")
    group.all_gather_rows(x, [4, 4])
    torch.cuda.synchronize()
    if rank == 1:
        torch.cuda._sleep(4_000_000_000)  # seconds of GPU time ahead of the write
        group.all_gather_rows(x, [4, 4])
        os._exit(0)
    group.all_gather_rows(x, [4, 4])  # queues a wait on lane 1's write (lost with lane 1)
    try:
        group.all_gather_rows(x, [4, 4])
        report["next"] = "no error"
    except PeerGoneError as e:
        report["next"] = str(e)
    try:
        done = torch.cuda.Event()
        done.record()
        t0 = time.perf_counter()
        while not done.query() and time.perf_counter() - t0 < 20.0:
            time.sleep(0.01)
        report["stream"] = "done" if done.query() else "stuck"
        report["stream_s"] = time.perf_counter() - t0
    except Exception as e:
        report["stream"] = f"error: {type(e).__name__}: {e}"
    t0 = time.perf_counter()
    group.destroy()
    report["destroy_s"] = time.perf_counter() - t0
    report["device_stuck"] = group.device_stuck
    Path(out_dir, f"dying{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no CUDA teardown under a stream that may be stuck


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peer_dying_with_its_write_queued(tmp_path: Path) -> None:
    mp.spawn(dying_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    report = json.loads((tmp_path / "dying0.json").read_text())
    print("peer died with its write queued:", report)
    # The host side fails the step at once and the teardown returns ...
    assert "died before posting exchange 3" in report["next"], report
    assert report["destroy_s"] < 5.0
    # ... but the stream stays stuck on the dead lane's event (measured on the H200,
    # docs/gpu-run/ipc/dying2.txt, even after recording that event from this side): the lane
    # knows it (device_stuck), and the worker restarts its process.
    assert report["stream"] == "stuck" and report["device_stuck"], report


# --- a group whose build fails after its gloo group started ---


class DiesWhileMapping(FakeIpcDevice):
    """The stand-in of a lane killed while the group is built (mapping its peers)."""

    __slots__ = ()

    def open(self, desc: dict) -> torch.Tensor:
        os._exit(0)  # exit code 0: mp.spawn would stop lane 0 too on another


def half_built_main(rank: int, port: int, out_dir: str, name: str) -> None:
    dev = DiesWhileMapping(name) if rank == 1 else FakeIpcDevice(name)
    report: dict = {}
    try:
        LaneGroup.create(rank, 2, "127.0.0.1", port, "cuda_ipc", 10.0, exchange_device=dev)
        report["create"] = "returned"
    except Exception as e:  # the agreement fails: lane 1 is gone
        report["create"] = type(e).__name__
    report["initialized"] = dist.is_initialized()
    report["files_left"] = [p for p in dev._files if os.path.exists(p)]
    for p in report["files_left"]:
        os.unlink(p)
    Path(out_dir, f"half{rank}.json").write_text(json.dumps(report))


def test_an_init_that_fails_leaves_torchs_group_counter_as_it_was(monkeypatch) -> None:
    """torch names a group's rendezvous keys by a counter every init counts up and only a
    destroy sets back: after an init that failed (a peer died in the rendezvous) this lane
    waited on other keys than a restarted peer's at every later group (each timed out, in a
    run of two spawned lanes), so its pool could not rebuild its group."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from cpkv.lanes import comm

    world = distributed_c10d._world
    monkeypatch.setattr(world, "group_count", 0)

    def dies_in_the_rendezvous(*_args, **_kwargs) -> None:
        world.group_count += 1  # as torch's own init does before it waits for its peers
        raise RuntimeError("wait timeout: a peer is gone")

    monkeypatch.setattr(dist, "init_process_group", dies_in_the_rendezvous)
    with pytest.raises(RuntimeError, match="peer is gone"):
        comm._init_process_group("gloo", rank=0, world_size=2, timeout=timedelta(seconds=1))
    assert world.group_count == 0 and not dist.is_initialized()


def test_a_group_that_fails_halfway_leaves_the_process_as_it_found_it(tmp_path: Path) -> None:
    """A peer dying while the ``cuda_ipc`` group is built fails the build after the gloo
    group started: left behind, it refused every later group of this lane (no restart
    either: the actor lives), and the exchange it mapped stayed open."""
    name = uuid.uuid4().hex
    try:
        mp.spawn(half_built_main, args=(free_port(), str(tmp_path), name), nprocs=2, join=True)
    finally:
        dead_lanes = remove_fake_files(name)  # lane 1 died without closing its stand-in
    report = json.loads((tmp_path / "half0.json").read_text())
    assert report == {"create": "RuntimeError", "initialized": False, "files_left": []}, report
    assert len(dead_lanes) == 5, dead_lanes  # lane 1's buffer and 4 events, now removed


# --- lanes as threads on one store (no processes): setup failures, teardown, refusals ---


def run_lanes(lane: Any, ws: int = 2) -> dict[int, BaseException]:
    """Run ``lane(rank)`` for every rank in threads; the exceptions they raised."""
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            lane(rank)
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def hash_store(timeout_s: float) -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


class NoUuid(FakeIpcDevice):
    """A stand-in whose device cannot be queried (as ``CudaIpcDevice(device)`` failing)."""

    __slots__ = ()

    def uuid(self) -> str:
        raise RuntimeError("cannot query the device")


SETUP_TIMEOUT_S = 4.0


@pytest.mark.parametrize(
    ("where", "failing"), [("board", 0), ("board", 1), ("adaptor", 0), ("adaptor", 1)]
)
def test_a_lane_failing_early_in_setup_fails_its_peer_at_once(
    monkeypatch: pytest.MonkeyPatch, where: str, failing: int
) -> None:
    """A lane that failed before it published its handles (its board, its adaptor in
    ``LaneGroup._build_ipc``) told nobody: its peer waited the store's whole timeout, and lane
    0's board file stayed in /dev/shm for good (only unlinked once every lane opened it)."""
    from cpkv.lanes import ipc

    real_board = ipc.Board

    def board(path: str, world_size: int, rank: int, *, create: bool = False) -> Board:
        if where == "board" and rank == failing:
            raise FileNotFoundError(path)  # e.g. lanes that do not share /dev/shm
        return real_board(path, world_size, rank, create=create)

    monkeypatch.setattr(ipc, "Board", board)
    store, generation, name = hash_store(SETUP_TIMEOUT_S), uuid.uuid4().hex, uuid.uuid4().hex
    prefix = f"cpkv/ipc/{generation}"
    took: dict[int, float] = {}

    def lane(rank: int) -> None:
        t0 = time.perf_counter()
        try:
            if where == "adaptor" and rank == failing:
                cpu = torch.device("cpu")
                LaneGroup._build_ipc(rank, 2, store, generation, cpu, SETUP_TIMEOUT_S, NoUuid(name))
            else:  # what _build_ipc runs once its adaptor is up
                ipc.IpcExchange(rank, 2, store, prefix, FakeIpcDevice(name), SETUP_TIMEOUT_S)
        finally:
            took[rank] = time.perf_counter() - t0

    try:
        errors = run_lanes(lane)
    finally:
        left = remove_fake_files(name)
        boards = glob.glob(board_path(prefix.replace("/", "-")))
        for path in boards:
            os.unlink(path)
    peer = 1 - failing
    assert sorted(errors) == [0, 1], errors
    assert f"lane {failing} could not set up its exchange" in str(errors[peer]), errors[peer]
    assert took[peer] < SETUP_TIMEOUT_S / 2, f"lane {peer} waited {took[peer]:.1f} s"
    assert boards == [] and left == [], (boards, left)


class NeverDone:
    """A CUDA event recorded on a stream stuck on a dead peer's event (never completes)."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return False


class RetiringStandIn(FakeIpcDevice):
    """Stand-in buffers with :class:`CudaIpcDevice`'s own bookkeeping of retired mappings."""

    __slots__ = ("_retired", "stuck")

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self._retired: list = []
        self.stuck = False

    retire = CudaIpcDevice.retire
    collect = CudaIpcDevice.collect

    def quiesce(self, grace_s: float = 0.0) -> bool:
        return not self.stuck


def test_a_stuck_close_keeps_the_retired_peer_mappings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stuck close kept the exchange's mappings in the graveyard but not the peer mappings it
    had retired to its adaptor (after a peer's regrowth): they were freed with the adaptor, and
    on CUDA freeing a received IPC storage synchronizes the stuck stream (a hang under the
    GIL)."""
    from cpkv.lanes.ipc import _GRAVEYARD, IpcExchange

    monkeypatch.setattr(torch.cuda, "Event", NeverDone)  # what retire/collect touch on CPU
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    store, name = hash_store(10.0), uuid.uuid4().hex
    devs = [RetiringStandIn(name), RetiringStandIn(name)]
    exs: list[Any] = [None, None]

    def lane(rank: int) -> None:
        ex = exs[rank] = IpcExchange(rank, 2, store, f"stuck/{name}", devs[rank], 10.0)
        small = torch.zeros(4, 4)
        ex.all_gather_rows(small, [4, 4])
        big = torch.zeros(70000, 4)  # > 1 MiB: lane 1 regrows, lane 0 retires its old mapping
        ex.all_gather_rows(big if rank == 1 else small, [4, 70000])

    graves = len(_GRAVEYARD)
    try:
        assert run_lanes(lane) == {}
        refs = [weakref.ref(m) for m, _ in devs[0]._retired]
        assert refs, "lane 0 retired its mapping of lane 1's first buffer"
        devs[0].stuck = True  # lane 1 died with a write queued: lane 0's stream never drains
        for ex in exs:
            ex.close()
        assert exs[0].stuck and len(_GRAVEYARD) == graves + 1
        exs.clear()
        devs.clear()
        gc.collect()  # the worker drops its group
        assert all(r() is not None for r in refs), "a retired mapping was freed after a stuck close"
    finally:
        del _GRAVEYARD[graves:]
        remove_fake_files(name)


def test_all_to_all_rows_refuses_mixed_dtypes_before_exchanging() -> None:
    """The exchange copies each part's raw bytes in the layout of ``send[0]``: parts of another
    dtype arrived as reinterpreted bits (or failed mid-collective), not refused."""
    from cpkv.lanes.ipc import IpcExchange

    store, name = hash_store(10.0), uuid.uuid4().hex
    got: dict[int, list[torch.Tensor]] = {}
    refused: list[str] = []

    def lane(rank: int) -> None:
        dev = FakeIpcDevice(name)
        ex = IpcExchange(rank, 2, store, f"dtypes/{name}", dev, 3.0)
        group = LaneGroup(rank, 2, "cuda_ipc", "gen", dev.device, store, ex)
        try:
            if rank == 0:
                mixed = [torch.tensor([[1.5, 2.5]]), torch.tensor([[7, 8]], dtype=torch.int32)]
                with pytest.raises(ValueError, match="send dtypes differ") as e:
                    group.all_to_all_rows(mixed, [1, 1])
                refused.append(str(e.value))
                assert ex.stats.exchanges == 0 and ex._book.seq == 0  # no exchange started
            send = [torch.full((1, 2), 10.0 * rank + q) for q in range(2)]
            got[rank] = group.all_to_all_rows(send, [1, 1])
        finally:
            group.destroy()

    assert run_lanes(lane) == {}
    assert "torch.float32" in refused[0] and "torch.int32" in refused[0], refused
    for rank in range(2):  # the lanes' next exchange is unaffected
        want = [torch.full((1, 2), 10.0 * p + rank) for p in range(2)]
        assert all(torch.equal(g, w) for g, w in zip(got[rank], want, strict=True)), got
    assert remove_fake_files(name) == []


class CountedShares(FakeIpcDevice):
    """Numbers every export (a CUDA IPC share, which carries a reference count of one) and
    records each share a peer opens."""

    __slots__ = ()
    lock = threading.Lock()
    numbers = itertools.count()
    opened: list[tuple[int, int]] = []  # (share, opening device's id)

    def export(self, buf: torch.Tensor) -> dict:
        with self.lock:
            return {**super().export(buf), "share": next(self.numbers)}

    def open(self, desc: dict) -> torch.Tensor:
        with self.lock:
            self.opened.append((desc["share"], id(self)))
        return super().open(desc)


def test_each_peer_opens_a_share_of_its_own_at_three_lanes() -> None:
    """A share is counted down once by each process that opens it: one share opened by two
    peers (three lanes or more) would free the block under the second, or never free it."""
    from cpkv.lanes.ipc import IpcExchange

    store, name = hash_store(10.0), uuid.uuid4().hex
    CountedShares.opened.clear()
    # NOTE: a stand-in buffer's file goes with its owner's close; the lanes close together.
    done = threading.Barrier(3, timeout=10.0)

    def lane(rank: int) -> None:
        ex = IpcExchange(rank, 3, store, f"shares/{name}", CountedShares(name), 10.0)
        try:
            ex.all_gather_rows(torch.zeros(4, 4), [4, 4, 4])
            big = torch.zeros(70000, 4)  # > 1 MiB: every lane regrows, every peer maps it anew
            ex.all_gather_rows(big, [70000] * 3)
            done.wait()
        finally:
            ex.close()

    try:
        assert run_lanes(lane, ws=3) == {}
    finally:
        remove_fake_files(name)
    shares = [share for share, _ in CountedShares.opened]
    assert len(shares) == 3 * 2 * 2  # 3 lanes x 2 peers x 2 buffers
    assert len(set(shares)) == len(shares), sorted(shares)
