"""Kernels vs their torch references (cpkv.kernels.naive, cpkv.kernels.req_to_token.naive),
validation, fallback.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 on small CPU tensors; with one
they run compiled on CUDA tensors, and extra larger cases join the parametrisations.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: before cpkv.kernels (and triton) are imported, so @triton.jit builds interpreted
    # kernels; the launchers also re-check at call time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib
import logging
from collections.abc import Callable

import pytest

import cpkv.kernels as K
import cpkv.kernels.req_to_token as RT
from cpkv.kernels import _common, naive
from cpkv.kernels.req_to_token import _common as rt_common
from cpkv.kernels.req_to_token import naive as rt_naive

# Submodules by path: the package re-exports functions under the same names.
wrt_mod = importlib.import_module("cpkv.kernels.req_to_token.write_req_to_token")
alloc_mod = importlib.import_module("cpkv.kernels.req_to_token.alloc_extend_slots")
store_mod = importlib.import_module("cpkv.kernels.store_kv")
gather_mod = importlib.import_module("cpkv.kernels.gather_kv")

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
KV_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]
SENTINEL = -7  # what table cells hold before a write; never a real slot


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def _i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def lens(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def random_lens(bs: int, max_len: int, seed: int) -> tuple[list[int], list[int]]:
    """(prefix_lens, seq_lens) with zeros, equal pairs (empty extends) and partial prefixes."""
    g = gen(seed)
    seq = torch.randint(0, max_len + 1, (bs,), generator=g)
    pre = (seq.double() * torch.rand(bs, generator=g)).long()
    pre[::4] = 0
    pre[1::5] = seq[1::5]  # empty extend
    return pre.tolist(), seq.tolist()


def test_kernel_tests_run_triton_not_the_fallback():
    # Otherwise every "kernel vs reference" test below would compare the reference with itself.
    assert _common.fallback_reason(DEVICE) is None


# ---------------------------------------------------------------------------------------------
# write_req_to_token
# ---------------------------------------------------------------------------------------------

BLOCK = wrt_mod.BLOCK
WRT_CASES = [
    pytest.param([0], [37], id="bs1-no-prefix"),
    pytest.param([5], [70], id="bs1-partial-prefix"),
    pytest.param([16], [16], id="bs1-empty-extend"),
    pytest.param([3], [3 + 2 * BLOCK + 37], id="bs1-three-blocks"),
    pytest.param([BLOCK + 9], [BLOCK + 20], id="bs1-prefix-over-a-block"),
    pytest.param([4, 4, 0], [4, 4, 0], id="bs3-all-empty"),
    pytest.param(*random_lens(13, 300, seed=1), id="bs13-mixed"),
    pytest.param([], [], id="bs0"),
]
if GPU:
    WRT_CASES += [
        pytest.param(*random_lens(64, 20_000, seed=2), id="bs64-20k"),
        pytest.param([0], [1 << 20], id="bs1-1M"),
    ]


def _wrt_inputs(pre: list[int], seq: list[int], seed: int, table_dtype: torch.dtype):
    bs = len(pre)
    g = gen(seed)
    max_reqs, ctx = bs + 3, max([*seq, 1]) + 5
    rows = torch.randperm(max_reqs, generator=g)[:bs]
    ext = sum(s - p for p, s in zip(pre, seq, strict=True))
    out_cache_loc = torch.randint(0, 1 << 30, (ext,), generator=g)
    prefix_locs = torch.randint(0, 1 << 30, (sum(pre),), generator=g)
    table = torch.full((max_reqs, ctx), SENTINEL, dtype=table_dtype)
    return table, rows, _i64(*pre), _i64(*seq), out_cache_loc, prefix_locs


def _wrt_loop(table, rows, pre, seq, out_cache_loc, prefix_locs) -> torch.Tensor:
    """The plain per-request definition, independent of naive.py."""
    table = table.clone()
    off = poff = 0
    for r, p, s in zip(rows.tolist(), pre.tolist(), seq.tolist(), strict=True):
        table[r, p:s] = out_cache_loc[off : off + s - p].to(table.dtype)
        off += s - p
        if prefix_locs is not None:
            table[r, :p] = prefix_locs[poff : poff + p].to(table.dtype)
            poff += p
    return table


@pytest.mark.parametrize("with_prefix", [False, True], ids=["new-only", "with-prefix"])
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize(("pre", "seq"), WRT_CASES)
@pytest.mark.parametrize("hints", [False, True], ids=["no-hints", "hints"])
def test_write_req_to_token_matches_reference(pre, seq, table_dtype, with_prefix, hints):
    table, rows, pre_t, seq_t, out, plocs = _wrt_inputs(pre, seq, len(pre), table_dtype)
    plocs = plocs if with_prefix else None
    expected = _wrt_loop(table, rows, pre_t, seq_t, out, plocs)
    ref = table.clone()
    rt_naive.write_req_to_token(ref, rows, pre_t, seq_t, out, plocs)
    assert torch.equal(ref, expected)

    got = dev(table)
    kwargs = {}
    if hints:  # over-estimates are allowed: they only add idle programs
        ext = [s - p for p, s in zip(pre, seq, strict=True)]
        kwargs = {"max_extend_len": max([*ext, 0]) + 3, "max_prefix_len": max([*pre, 0]) + 1}
    RT.write_req_to_token(
        got,
        dev(rows),
        dev(pre_t),
        dev(seq_t),
        dev(out),
        None if plocs is None else dev(plocs),
        **kwargs,
    )
    assert torch.equal(got.cpu(), expected)


class _GridRecorder:
    """Stands in for a kernel object and records the grid of each launch."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        self.grids.append(grid)
        return _common.for_current_mode(self.kernel)[grid]


def test_write_req_to_token_launches_many_programs_per_request(monkeypatch):
    pre, seq = [0, 7], [3 * BLOCK + 5, 40]
    table, rows, pre_t, seq_t, out, _ = _wrt_inputs(pre, seq, seed=3, table_dtype=torch.int64)
    recorder = _GridRecorder(wrt_mod._write_req_to_token_kernel)
    monkeypatch.setattr(wrt_mod, "_write_req_to_token_kernel", recorder)
    got = dev(table)
    RT.write_req_to_token(got, dev(rows), dev(pre_t), dev(seq_t), dev(out))
    # (blocks of the longest extend, requests): 4 programs for the first request alone.
    assert recorder.grids == [(4, 2)]
    assert torch.equal(got.cpu(), _wrt_loop(table, rows, pre_t, seq_t, out, None))


def test_requests_beyond_grid_limit_launch_in_chunks(monkeypatch):
    # CUDA caps grid axis 1 at 65535 requests; shrink the cap to see the chunked launches.
    monkeypatch.setattr(rt_common, "MAX_GRID_Y", 3)
    pre, seq = random_lens(8, 40, seed=14)
    table, rows, pre_t, seq_t, out, plocs = _wrt_inputs(pre, seq, 14, torch.int64)
    recorder = _GridRecorder(wrt_mod._write_req_to_token_kernel)
    monkeypatch.setattr(wrt_mod, "_write_req_to_token_kernel", recorder)
    got = dev(table)
    RT.write_req_to_token(got, dev(rows), dev(pre_t), dev(seq_t), dev(out), dev(plocs))
    assert [grid[1] for grid in recorder.grids] == [3, 3, 2]
    assert torch.equal(got.cpu(), _wrt_loop(table, rows, pre_t, seq_t, out, plocs))

    last_loc, new_pages = _alloc_inputs(pre, seq, 5, seed=15)
    slots = RT.alloc_extend_slots(dev(pre_t), dev(seq_t), dev(last_loc), dev(new_pages), 5)
    assert torch.equal(slots.cpu(), _alloc_loop(pre, seq, last_loc, new_pages, 5))


# ---------------------------------------------------------------------------------------------
# get_last_loc
# ---------------------------------------------------------------------------------------------

LAST_LOC_CASES = [
    pytest.param([0], id="bs1-empty-prefix"),
    pytest.param([1], id="bs1-one-token"),
    pytest.param([0, 3, 0, 40, 41], id="bs5-mixed"),
    pytest.param([41] * 3, id="full-row"),
    pytest.param([], id="bs0"),
]
if GPU:
    LAST_LOC_CASES.append(pytest.param(random_lens(700, 41, seed=4)[0], id="bs700"))


@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("pre", LAST_LOC_CASES)
def test_get_last_loc_matches_reference(pre, table_dtype):
    g = gen(5)
    table = torch.randint(0, 1 << 30, (len(pre) + 2, 41), generator=g).to(table_dtype)
    rows = torch.randperm(len(pre) + 2, generator=g)[: len(pre)]
    pre_t = _i64(*pre)
    expected = torch.tensor(
        [int(table[r, p - 1]) if p > 0 else -1 for r, p in zip(rows.tolist(), pre, strict=True)],
        dtype=torch.int64,
    )
    assert torch.equal(rt_naive.get_last_loc(table, rows, pre_t), expected)
    got = RT.get_last_loc(dev(table), dev(rows), dev(pre_t))
    assert got.dtype == torch.int64 and got.device.type == DEVICE.type
    assert torch.equal(got.cpu(), expected)


# ---------------------------------------------------------------------------------------------
# alloc_extend_slots
# ---------------------------------------------------------------------------------------------


def _alloc_inputs(pre: list[int], seq: list[int], page_size: int, seed: int):
    """A consistent layout: prefix slots on random pages, last_loc = the last prefix slot."""
    g = gen(seed)
    cdiv = _common.cdiv
    pages_needed = sum(cdiv(s, page_size) for s in seq)
    pages = torch.randperm(pages_needed + 5, generator=g)[:pages_needed].tolist()
    last_loc, new_pages = [], []
    for p, s in zip(pre, seq, strict=True):
        own = [pages.pop() for _ in range(cdiv(s, page_size))]
        prefix_pages = cdiv(p, page_size)
        last_loc.append(own[prefix_pages - 1] * page_size + (p - 1) % page_size if p else -1)
        new_pages += own[prefix_pages:]
    return _i64(*last_loc), _i64(*new_pages)


def _alloc_loop(pre, seq, last_loc, new_pages, page_size) -> torch.Tensor:
    """The plain per-token definition, independent of naive.py."""
    out, k = [], 0
    for p, s, last in zip(pre, seq, last_loc.tolist(), strict=True):
        first_new = _common.cdiv(p, page_size) * page_size
        for pos in range(p, s):
            if pos < first_new:
                out.append(last + 1 + pos - p)
            else:
                page = new_pages[k + (pos - first_new) // page_size]
                out.append(int(page) * page_size + pos % page_size)
        k += _common.cdiv(s, page_size) - _common.cdiv(p, page_size)
    return torch.tensor(out, dtype=torch.int64)


ALLOC_CASES = [
    pytest.param([0], [23], id="bs1-no-prefix"),
    pytest.param([3], [40], id="bs1-partial-prefix"),
    pytest.param([32], [50], id="bs1-aligned-prefix"),
    pytest.param([3], [4], id="bs1-inside-partial-page"),
    pytest.param([9], [9], id="bs1-empty-extend"),
    pytest.param([0], [2 * alloc_mod.BLOCK + 3], id="bs1-three-blocks"),
    pytest.param(*random_lens(11, 90, seed=6), id="bs11-mixed"),
    pytest.param([], [], id="bs0"),
]
if GPU:
    ALLOC_CASES.append(pytest.param(*random_lens(200, 5000, seed=7), id="bs200-5k"))


@pytest.mark.parametrize("page_size", [1, 16, 7], ids=["page1", "page16", "page7"])
@pytest.mark.parametrize(("pre", "seq"), ALLOC_CASES)
@pytest.mark.parametrize("hints", [False, True], ids=["no-hints", "hints"])
def test_alloc_extend_slots_matches_reference(pre, seq, page_size, hints):
    last_loc, new_pages = _alloc_inputs(pre, seq, page_size, seed=len(pre) + page_size)
    pre_t, seq_t = _i64(*pre), _i64(*seq)
    expected = _alloc_loop(pre, seq, last_loc, new_pages, page_size)
    ref = rt_naive.alloc_extend_slots(pre_t, seq_t, last_loc, new_pages, page_size)
    assert torch.equal(ref, expected)
    kwargs = {}
    if hints:
        ext = [s - p for p, s in zip(pre, seq, strict=True)]
        kwargs = {"extend_num_tokens": sum(ext), "max_extend_len": max([*ext, 0]) + 2}
    got = RT.alloc_extend_slots(
        dev(pre_t), dev(seq_t), dev(last_loc), dev(new_pages), page_size, **kwargs
    )
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), expected)


# ---------------------------------------------------------------------------------------------
# store_kv / gather_kv
# ---------------------------------------------------------------------------------------------

KV_SHAPES = [  # (tokens, heads, dim, pages, page_size)
    pytest.param(37, 3, 24, 9, 5, id="T37-H3xD24-page5"),
    pytest.param(1, 1, 5, 1, 1, id="T1-H1xD5-page1"),
    pytest.param(50, 2, 64, 4, 16, id="T50-H2xD64-page16"),
    pytest.param(20, 8, 128, 3, 7, id="T20-H8xD128-page7"),
    pytest.param(0, 2, 8, 2, 4, id="T0"),
]
if GPU:
    KV_SHAPES.append(pytest.param(5000, 8, 128, 400, 16, id="T5000-H8xD128-page16"))


def _kv_inputs(t, h, d, pages, page_size, dtype, seed, skip_every: int = 4):
    g = gen(seed)
    k = torch.randn(t, h, d, generator=g).to(dtype)
    v = torch.randn(t, h, d, generator=g).to(dtype)
    k_shard = torch.randn(pages, page_size, h, d, generator=g).to(dtype)
    v_shard = torch.randn(pages, page_size, h, d, generator=g).to(dtype)
    slots = torch.randperm(pages * page_size, generator=g)[:t]  # random order, distinct
    slots[::skip_every] = -1
    return k, v, k_shard, v_shard, slots


def _store_loop(k, v, k_shard, v_shard, slots):
    k_shard, v_shard = k_shard.clone(), v_shard.clone()
    kf, vf = k_shard.view(-1, *k.shape[1:]), v_shard.view(-1, *k.shape[1:])
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kf[s], vf[s] = k[t], v[t]
    return k_shard, v_shard


def _gather_loop(k_shard, v_shard, slots):
    out = []
    for shard in (k_shard, v_shard):
        flat = shard.view(-1, *shard.shape[2:])
        rows = torch.zeros(slots.numel(), *shard.shape[2:], dtype=shard.dtype)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                rows[t] = flat[s]
        out.append(rows)
    return out[0], out[1]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("t", "h", "d", "pages", "page_size"), KV_SHAPES)
def test_store_kv_matches_reference(t, h, d, pages, page_size, dtype):
    k, v, k_shard, v_shard, slots = _kv_inputs(t, h, d, pages, page_size, dtype, seed=t + h)
    exp_k, exp_v = _store_loop(k, v, k_shard, v_shard, slots)
    ref_k, ref_v = k_shard.clone(), v_shard.clone()
    naive.store_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(ref_k, exp_k) and torch.equal(ref_v, exp_v)
    got_k, got_v = dev(k_shard), dev(v_shard)
    K.store_kv(dev(k), dev(v), got_k, got_v, dev(slots))
    assert torch.equal(got_k.cpu(), exp_k) and torch.equal(got_v.cpu(), exp_v)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("t", "h", "d", "pages", "page_size"), KV_SHAPES)
def test_gather_kv_matches_reference(t, h, d, pages, page_size, dtype):
    _, _, k_shard, v_shard, slots = _kv_inputs(t, h, d, pages, page_size, dtype, seed=t + d)
    exp_k, exp_v = _gather_loop(k_shard, v_shard, slots)
    ref_k, ref_v = naive.gather_kv(k_shard, v_shard, slots)
    assert torch.equal(ref_k, exp_k) and torch.equal(ref_v, exp_v)
    got_k, got_v = K.gather_kv(dev(k_shard), dev(v_shard), dev(slots))
    assert got_k.shape == (t, h, d) and got_k.dtype == dtype and got_k.is_contiguous()
    assert torch.equal(got_k.cpu(), exp_k) and torch.equal(got_v.cpu(), exp_v)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=DTYPE_IDS)
def test_store_kv_strided_tokens_and_gather_round_trip(dtype):
    # K and V as slices of one fused [T, q + k + v heads, D] tensor: token stride > H * D.
    t, h, d, pages, page_size = 29, 2, 24, 8, 5
    g = gen(8)
    qkv = torch.randn(t, 3 * h, d, generator=g).to(dtype)
    k, v = qkv[:, h : 2 * h], qkv[:, 2 * h :]
    k_shard = torch.zeros(pages, page_size, h, d, dtype=dtype)
    v_shard = torch.zeros_like(k_shard)
    slots = torch.randperm(pages * page_size, generator=g)[:t]
    exp_k, exp_v = _store_loop(k, v, k_shard, v_shard, slots)
    got_k, got_v = dev(k_shard), dev(v_shard)
    K.store_kv(dev(qkv)[:, h : 2 * h], dev(qkv)[:, 2 * h :], got_k, got_v, dev(slots))
    assert torch.equal(got_k.cpu(), exp_k) and torch.equal(got_v.cpu(), exp_v)
    back_k, back_v = K.gather_kv(got_k, got_v, dev(slots))
    assert torch.equal(back_k.cpu(), k) and torch.equal(back_v.cpu(), v)


@pytest.mark.parametrize("mod", [store_mod, gather_mod], ids=["store_kv", "gather_kv"])
def test_kv_kernels_split_rows_across_programs(monkeypatch, mod):
    # Tiny tiles: a 72-wide row spans 3 programs of 32 (the last one masked), 2 tokens each.
    monkeypatch.setattr(mod, "MAX_BLOCK_E", 32)
    monkeypatch.setattr(mod, "TILE_ELEMS", 64)
    k, v, k_shard, v_shard, slots = _kv_inputs(11, 3, 24, 4, 5, torch.bfloat16, seed=9)
    if mod is store_mod:
        exp_k, exp_v = _store_loop(k, v, k_shard, v_shard, slots)
        got_k, got_v = dev(k_shard), dev(v_shard)
        K.store_kv(dev(k), dev(v), got_k, got_v, dev(slots))
    else:
        exp_k, exp_v = _gather_loop(k_shard, v_shard, slots)
        got_k, got_v = K.gather_kv(dev(k_shard), dev(v_shard), dev(slots))
    assert torch.equal(got_k.cpu(), exp_k) and torch.equal(got_v.cpu(), exp_v)


# ---------------------------------------------------------------------------------------------
# Validation: each bad input raises ValueError naming the offending value.
# ---------------------------------------------------------------------------------------------


def _table(rows: int = 4, cols: int = 16, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=dtype)


def _shard(dtype: torch.dtype = torch.float32, h: int = 2, d: int = 8) -> torch.Tensor:
    return torch.zeros(3, 4, h, d, dtype=dtype)


def _kv(t: int = 5, h: int = 2, d: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(t, h, d, dtype=dtype)


BAD_CALLS: list[tuple[str, Callable[[], object], str]] = [
    # write_req_to_token
    (
        "wrt-1d-table",
        lambda: RT.write_req_to_token(
            torch.zeros(8, dtype=torch.int64), _i64(0), _i64(0), _i64(2), _i64(1, 2)
        ),
        "req_to_token must be 2-D, got shape (8,)",
    ),
    (
        "wrt-float-table",
        lambda: RT.write_req_to_token(
            _table(dtype=torch.float32), _i64(0), _i64(0), _i64(2), _i64(1, 2)
        ),
        "req_to_token has dtype torch.float32",
    ),
    (
        "wrt-strided-table",
        lambda: RT.write_req_to_token(_table()[:, ::2], _i64(0), _i64(0), _i64(2), _i64(1, 2)),
        "req_to_token rows must be contiguous, got shape (4, 8) with strides (16, 2)",
    ),
    (
        "wrt-len-mismatch",
        lambda: RT.write_req_to_token(_table(), _i64(0, 1), _i64(0), _i64(2), _i64(1, 2)),
        "req_pool_indices has shape (2,), prefix_lens has shape (1,)",
    ),
    (
        "wrt-int32-slots",
        lambda: RT.write_req_to_token(
            _table(), _i64(0), _i64(0), _i64(2), torch.tensor([1, 2], dtype=torch.int32)
        ),
        "out_cache_loc has dtype torch.int32",
    ),
    (
        "wrt-float-lens",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(0), torch.tensor([2.0]), _i64(1, 2)),
        "seq_lens has dtype torch.float32",
    ),
    (
        "wrt-strided-slots",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(0), _i64(2), _i64(1, 9, 2)[::2]),
        "out_cache_loc must be contiguous",
    ),
    (
        "wrt-count-mismatch",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(1), _i64(7), _i64(1, 2)),
        "out_cache_loc has 2 elements but extend lengths sum to 6",
    ),
    (
        "wrt-prefix-count-mismatch",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(3), _i64(4), _i64(1), _i64(5)),
        "prefix_locs has 1 elements but prefix_lens sum to 3",
    ),
    (
        "wrt-seq-below-prefix",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(5), _i64(3), _i64()),
        "seq_lens [3] < prefix_lens [5]",
    ),
    (
        "wrt-row-outside",
        lambda: RT.write_req_to_token(_table(), _i64(4), _i64(0), _i64(2), _i64(1, 2)),
        "req_pool_indices must lie in [0, 4), got [4, 4]",
    ),
    (
        "wrt-negative-prefix",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(-1), _i64(1), _i64(1, 2)),
        "lengths must lie in [0, 16] (req_to_token's width), got prefix_lens down to -1",
    ),
    (
        "wrt-past-width",
        lambda: RT.write_req_to_token(_table(), _i64(0), _i64(0), _i64(17), _i64(*range(17))),
        "seq_lens up to 17",
    ),
    (
        "wrt-negative-hint",
        lambda: RT.write_req_to_token(
            _table(), _i64(0), _i64(0), _i64(2), _i64(1, 2), max_extend_len=-1
        ),
        "max_extend_len must be a non-negative int or None, got -1",
    ),
    (
        "wrt-device-mismatch",
        lambda: RT.write_req_to_token(
            _table(), _i64(0), _i64(0), _i64(2), torch.zeros(2, dtype=torch.int64, device="meta")
        ),
        "out_cache_loc on meta",
    ),
    (
        "wrt-not-a-tensor",
        lambda: RT.write_req_to_token(_table(), [0], _i64(0), _i64(2), _i64(1, 2)),
        "req_pool_indices must be a torch.Tensor, got list",
    ),
    # get_last_loc
    (
        "last-3d-table",
        lambda: RT.get_last_loc(torch.zeros(2, 2, 2, dtype=torch.int64), _i64(0), _i64(1)),
        "req_to_token must be 2-D, got shape (2, 2, 2)",
    ),
    (
        "last-len-mismatch",
        lambda: RT.get_last_loc(_table(), _i64(0, 1, 2), _i64(1)),
        "req_pool_indices has shape (3,), prefix_lens has shape (1,)",
    ),
    (
        "last-2d-lens",
        lambda: RT.get_last_loc(_table(), _i64(0), _i64(1).view(1, 1)),
        "prefix_lens must be 1-D, got shape (1, 1)",
    ),
    # alloc_extend_slots
    (
        "alloc-page-size-0",
        lambda: RT.alloc_extend_slots(_i64(0), _i64(4), _i64(-1), _i64(1), 0),
        "page_size must be an int >= 1, got 0",
    ),
    (
        "alloc-page-size-float",
        lambda: RT.alloc_extend_slots(_i64(0), _i64(4), _i64(-1), _i64(1), 4.0),
        "page_size must be an int >= 1, got 4.0",
    ),
    (
        "alloc-negative-prefix",
        lambda: RT.alloc_extend_slots(_i64(-2), _i64(3), _i64(-1), _i64(1, 2), 4),
        "prefix_lens [-2] must be >= 0",
    ),
    (
        "rope-bool-heads",
        lambda: K.rope_qkv(torch.zeros(2, 48), torch.zeros(2, 16), torch.zeros(2, 16), True, True),
        "num_heads=True must be an int >= 1",
    ),
    (
        "alloc-page-count",
        lambda: RT.alloc_extend_slots(_i64(0), _i64(9), _i64(-1), _i64(1, 2), 4),
        "new_pages has 2 elements but new page counts sum to 3",
    ),
    (
        "alloc-token-count",
        lambda: RT.alloc_extend_slots(
            _i64(0), _i64(9), _i64(-1), _i64(1, 2, 3), 4, extend_num_tokens=8
        ),
        "extend_num_tokens=8 but extend lengths sum to 9",
    ),
    (
        "alloc-len-mismatch",
        lambda: RT.alloc_extend_slots(_i64(0, 0), _i64(4), _i64(-1), _i64(1), 4),
        "prefix_lens has shape (2,), seq_lens has shape (1,)",
    ),
    (
        "alloc-float-pages",
        lambda: RT.alloc_extend_slots(_i64(0), _i64(4), _i64(-1), torch.tensor([1.0]), 4),
        "new_pages has dtype torch.float32",
    ),
    # store_kv
    (
        "store-v-shape",
        lambda: K.store_kv(_kv(), _kv(d=4), _shard(), _shard(), _i64(0, 1, 2, 3, 4)),
        "store_kv: k has shape (5, 2, 8) but v has shape (5, 2, 4)",
    ),
    (
        "store-shard-hd",
        lambda: K.store_kv(_kv(h=3), _kv(h=3), _shard(), _shard(), _i64(0, 1, 2, 3, 4)),
        "k has shape (5, 3, 8) but k_shard has shape (3, 4, 2, 8)",
    ),
    (
        "store-shard-pair",
        lambda: K.store_kv(_kv(), _kv(), _shard(), torch.zeros(2, 4, 2, 8), _i64(0, 1, 2, 3, 4)),
        "k_shard has shape (3, 4, 2, 8) but v_shard has shape (2, 4, 2, 8)",
    ),
    (
        "store-dtype",
        lambda: K.store_kv(
            _kv(dtype=torch.float16),
            _kv(dtype=torch.float16),
            _shard(),
            _shard(),
            _i64(0, 1, 2, 3, 4),
        ),
        "k has dtype torch.float16 but k_shard has dtype torch.float32",
    ),
    (
        "store-int-shard",
        lambda: K.store_kv(_kv(), _kv(), _shard().int(), _shard().int(), _i64(0, 1, 2, 3, 4)),
        "k_shard has dtype torch.int32, expected one of (float16, bfloat16, float32)",
    ),
    (
        "store-slot-count",
        lambda: K.store_kv(_kv(), _kv(), _shard(), _shard(), _i64(0, 1, 2, 3)),
        "k has 5 tokens but local_slots has shape (4,)",
    ),
    (
        "store-int32-slots",
        lambda: K.store_kv(_kv(), _kv(), _shard(), _shard(), torch.arange(5, dtype=torch.int32)),
        "local_slots has dtype torch.int32",
    ),
    (
        "store-strided-shard",
        lambda: K.store_kv(
            _kv(), _kv(), torch.zeros(3, 4, 2, 16)[..., ::2], _shard(), _i64(0, 1, 2, 3, 4)
        ),
        "k_shard must be contiguous, got shape (3, 4, 2, 8) with strides (128, 32, 16, 2)",
    ),
    (
        "store-strided-rows",
        lambda: K.store_kv(
            torch.zeros(5, 8, 2).transpose(1, 2), _kv(), _shard(), _shard(), _i64(0, 1, 2, 3, 4)
        ),
        "k must have contiguous [H, D] rows, got shape (5, 2, 8) with strides (16, 1, 2)",
    ),
    (
        "store-2d-k",
        lambda: K.store_kv(torch.zeros(5, 16), _kv(), _shard(), _shard(), _i64(0, 1, 2, 3, 4)),
        "k must be 3-D, got shape (5, 16) (2-D)",
    ),
    (
        "store-device",
        lambda: K.store_kv(_kv(), _kv(), _shard(), _shard(), torch.arange(5, device="meta")),
        "local_slots on meta",
    ),
    # gather_kv
    (
        "gather-shard-pair",
        lambda: K.gather_kv(_shard(), _shard(h=1), _i64(0)),
        "gather_kv: k_shard has shape (3, 4, 2, 8) but v_shard has shape (3, 4, 1, 8)",
    ),
    (
        "gather-dtype-pair",
        lambda: K.gather_kv(_shard(), _shard(torch.float16), _i64(0)),
        "k_shard has dtype torch.float32 but v_shard has dtype torch.float16",
    ),
    (
        "gather-2d-slots",
        lambda: K.gather_kv(_shard(), _shard(), _i64(0, 1).view(1, 2)),
        "local_slots must be 1-D, got shape (1, 2)",
    ),
]


@pytest.mark.parametrize(("call", "message"), [pytest.param(c, m, id=i) for i, c, m in BAD_CALLS])
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_bad_input_leaves_outputs_unchanged():
    table = _table()
    with pytest.raises(ValueError):
        RT.write_req_to_token(table, _i64(0), _i64(0), _i64(3), _i64(1, 2))
    assert int(table.abs().sum()) == 0


# ---------------------------------------------------------------------------------------------
# Empty inputs, fallback and interpreter mode
# ---------------------------------------------------------------------------------------------


def test_empty_inputs_do_nothing():
    table = dev(torch.full((2, 4), SENTINEL))
    RT.write_req_to_token(table, lens([]), lens([]), lens([]), lens([]), lens([]))
    RT.write_req_to_token(table, lens([0, 1]), lens([2, 0]), lens([2, 0]), lens([]))
    assert bool((table == SENTINEL).all())
    # Empty extends with prefixes: only the prefix slots land.
    RT.write_req_to_token(table, lens([0, 1]), lens([2, 0]), lens([2, 0]), lens([]), lens([1, 2]))
    assert torch.equal(table.cpu(), torch.tensor([[1, 2, -7, -7], [-7, -7, -7, -7]]))
    assert RT.alloc_extend_slots(lens([4]), lens([4]), lens([3]), lens([]), 4).numel() == 0
    assert RT.get_last_loc(table, lens([]), lens([])).shape == (0,)
    shard = dev(torch.ones(2, 4, 2, 8))
    K.store_kv(dev(_kv(t=0)), dev(_kv(t=0)), shard, shard.clone(), lens([]))
    assert bool((shard == 1).all())
    k, v = K.gather_kv(shard, shard, lens([]))
    assert k.shape == v.shape == (0, 2, 8)


def _fallback_calls() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(kernel name, launcher call, reference call) on CPU tensors."""
    g = gen(10)
    table = torch.randint(0, 100, (4, 16), generator=g)
    k, v, k_shard, v_shard, slots = _kv_inputs(6, 2, 8, 3, 4, torch.float16, seed=11)
    last_loc, new_pages = _alloc_inputs([3, 0], [9, 5], 4, seed=12)
    wrt_args = (_i64(2, 0), _i64(3, 0), _i64(9, 5), torch.arange(11), torch.arange(3))
    alloc_args = (_i64(3, 0), _i64(9, 5), last_loc, new_pages, 4)

    def store(fn):
        ks, vs = k_shard.clone(), v_shard.clone()
        fn(k, v, ks, vs, slots)
        return ks, vs

    def wrt(fn):
        t = table.clone()
        fn(t, *wrt_args)
        return t

    return [
        (
            "write_req_to_token",
            lambda: wrt(RT.write_req_to_token),
            lambda: wrt(rt_naive.write_req_to_token),
        ),
        (
            "get_last_loc",
            lambda: RT.get_last_loc(table, _i64(1, 2), _i64(0, 5)),
            lambda: rt_naive.get_last_loc(table, _i64(1, 2), _i64(0, 5)),
        ),
        (
            "alloc_extend_slots",
            lambda: RT.alloc_extend_slots(*alloc_args),
            lambda: rt_naive.alloc_extend_slots(*alloc_args),
        ),
        ("store_kv", lambda: store(K.store_kv), lambda: store(naive.store_kv)),
        (
            "gather_kv",
            lambda: K.gather_kv(k_shard, v_shard, slots),
            lambda: naive.gather_kv(k_shard, v_shard, slots),
        ),
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[call-overload]


@pytest.mark.parametrize("reason", ["no-interpreter", "no-triton"])
@pytest.mark.parametrize(
    ("name", "call", "reference"), [pytest.param(*c, id=c[0]) for c in _fallback_calls()]
)
def test_fallback_uses_reference_and_logs_once(monkeypatch, caplog, reason, name, call, reference):
    if reason == "no-interpreter":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        expected_reason = "TRITON_INTERPRET is not 1"
    else:
        monkeypatch.setattr(_common, "_TRITON_IMPORT_ERROR", "ImportError: no triton")
        expected_reason = "triton import failed (ImportError: no triton)"
    monkeypatch.setattr(_common, "_fallback_logged", set())
    caplog.set_level(logging.INFO, logger="cpkv.kernels")
    first, second = call(), call()
    assert _same(first, reference()) and _same(second, first)
    records = [r for r in caplog.records if r.name == "cpkv.kernels"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert name in records[0].getMessage() and expected_reason in records[0].getMessage()


def test_interpreter_is_read_at_call_time(monkeypatch):
    """A kernel built for the wrong mode (env changed after import) is rebuilt, not misused."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled = JITFunction(store_mod._store_kv_kernel.fn)
    assert isinstance(_common.for_current_mode(compiled), InterpretedFunction)
    monkeypatch.setattr(store_mod, "_store_kv_kernel", compiled)
    k, v, k_shard, v_shard, slots = _kv_inputs(9, 2, 8, 3, 4, torch.float32, seed=13)
    exp_k, exp_v = _store_loop(k, v, k_shard, v_shard, slots)
    K.store_kv(k, v, k_shard, v_shard, slots)  # CPU tensors: only the interpreter can run this
    assert torch.equal(k_shard, exp_k) and torch.equal(v_shard, exp_v)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _common.fallback_reason(torch.device("cpu")) is not None
    assert _common.fallback_reason(torch.device("cuda")) is None
