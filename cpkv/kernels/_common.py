"""Shared plumbing for the kernels: Triton availability, fallback logging, input validation.

Nothing here imports the rest of :mod:`cpkv`, so ``import cpkv.kernels`` works on its own.
"""

from __future__ import annotations

import logging
import math
import os
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

logger = logging.getLogger("cpkv.kernels")

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
    _TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # any failure (missing wheel, broken driver libs) means "no Triton"
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    InterpretedFunction = JITFunction = None  # type: ignore[assignment,misc]
    HAS_TRITON = False
    _TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

# Kernel names whose fallback was already logged (log once per kernel, not per call).
_fallback_logged: set[str] = set()
# (raw kernel function, interpret?) -> kernel object built for that mode.
_rebuilt_kernels: dict[tuple[Callable[..., Any], bool], Any] = {}


def interpreter_enabled() -> bool:
    """Whether Triton's interpreter is on right now (``TRITON_INTERPRET``, read at call time)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        # triton >= 3.4: knobs re-read the environment on every access unless set in code.
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fallback_reason(device: torch.device) -> str | None:
    """Why Triton cannot run kernels on ``device`` now, or ``None`` when it can.

    Args:
        device: device of the kernel's tensors.

    Returns:
        A short human-readable reason, or ``None``.
    """
    if _TRITON_IMPORT_ERROR is not None:
        return f"triton import failed ({_TRITON_IMPORT_ERROR})"
    if device.type == "cuda" or interpreter_enabled():
        return None
    return f"tensors on {device.type} and TRITON_INTERPRET is not 1"


def log_fallback_once(kernel: str, reason: str) -> None:
    """Log (once per kernel name per process) that ``kernel`` runs its torch reference."""
    if kernel in _fallback_logged:
        return
    _fallback_logged.add(kernel)
    # NOTE: CPU tensors without the interpreter are the expected case on a machine without
    # a GPU: say so quietly; a failed Triton import is worth a warning.
    level = logging.WARNING if _TRITON_IMPORT_ERROR is not None else logging.INFO
    logger.log(level, "%s: Triton cannot run (%s); using the torch reference", kernel, reason)


def use_triton(kernel: str, device: torch.device) -> bool:
    """True when ``kernel`` can run with Triton on ``device``; otherwise logs the fallback once."""
    reason = fallback_reason(device)
    if reason is None:
        return True
    log_fallback_once(kernel, reason)
    return False


def for_current_mode(kernel: Any) -> Any:
    """Return ``kernel`` built for the current ``TRITON_INTERPRET`` setting.

    ``@triton.jit`` picks compiled-vs-interpreted once, at import; the environment may change
    after that (tests, notebooks), so a kernel of the wrong kind is rebuilt from its Python
    function (cached). Anything that is not a Triton kernel object is returned unchanged.
    """
    want_interp = interpreter_enabled()
    if isinstance(kernel, InterpretedFunction):
        is_interp = True
    elif isinstance(kernel, JITFunction):
        is_interp = False
    else:
        return kernel
    if is_interp == want_interp:
        return kernel
    key = (kernel.fn, want_interp)
    if key not in _rebuilt_kernels:
        _rebuilt_kernels[key] = (InterpretedFunction if want_interp else JITFunction)(
            _with_helpers_for_current_mode(kernel.fn)
        )
    return _rebuilt_kernels[key]


def _with_helpers_for_current_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` calling its ``@triton.jit`` helpers built for the current mode too.

    A kernel finds its helpers in its module's globals, built in the import-time mode; a kernel
    of one kind cannot call a helper of the other, so the rebuilt kernel gets a copy of those
    globals with its helpers rebuilt (the module's own are left as they are).
    """
    scope = fn.__globals__
    helpers = {
        name: for_current_mode(scope[name])
        for name in fn.__code__.co_names
        if isinstance(scope.get(name), (InterpretedFunction, JITFunction))
    }
    if all(helper is scope[name] for name, helper in helpers.items()):
        return fn
    return types.FunctionType(
        fn.__code__, {**scope, **helpers}, fn.__name__, fn.__defaults__, fn.__closure__
    )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Validation helpers: each raises ValueError("<kernel>: <what> ...") naming the offending values.
# ---------------------------------------------------------------------------------------------

INT_DTYPES = (torch.int32, torch.int64)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    kernel: str,
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype and contiguity; return it.

    Raises:
        ValueError: naming ``kernel``, ``name`` and the offending value.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{kernel}: {name} must be {ndim}-D, got shape {tuple(t.shape)} ({t.dim()}-D)"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"{kernel}: {name} has dtype {t.dtype}, expected one of ({_dtype_names(dtypes)})"
        )
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{kernel}: {name} must be contiguous, got shape {tuple(t.shape)} "
            f"with strides {t.stride()}"
        )
    return t


def check_same_device(kernel: str, **tensors: torch.Tensor | None) -> torch.device:
    """Check that all given (non-None) tensors share one device; return it.

    Raises:
        ValueError: listing each tensor's device when they differ.
    """
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"{kernel}: tensors must share one device, got {listing}")
    return next(iter(devices))


def check_hint(kernel: str, name: str, value: int | None) -> None:
    """Check an optional host-side size hint (a non-negative int or None).

    Raises:
        ValueError: when ``value`` is negative or not an int.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{kernel}: {name} must be a non-negative int or None, got {value!r}")


def check_real(kernel: str, name: str, value: object, *, positive: bool) -> float:
    """Check a host-side real number (not a bool): finite and ``> 0`` (``positive``) or
    ``>= 0``.

    Raises:
        ValueError: naming ``value``.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{kernel}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


def check_kv_shards(kernel: str, k_shard: object, v_shard: object) -> torch.Tensor:
    """Check a lane's K and V shard pair: [P, page_size, H, D], one shape and KV dtype, contiguous.

    Returns:
        ``k_shard``.

    Raises:
        ValueError: naming the offending shapes, dtypes or strides.
    """
    k_shard = check_tensor(kernel, "k_shard", k_shard, ndim=4, dtypes=KV_DTYPES, contiguous=True)
    v_shard = check_tensor(kernel, "v_shard", v_shard, ndim=4, dtypes=KV_DTYPES, contiguous=True)
    if k_shard.shape != v_shard.shape:
        raise ValueError(
            f"{kernel}: k_shard has shape {tuple(k_shard.shape)} but v_shard has shape "
            f"{tuple(v_shard.shape)}"
        )
    if k_shard.dtype != v_shard.dtype:
        raise ValueError(
            f"{kernel}: k_shard has dtype {k_shard.dtype} but v_shard has dtype {v_shard.dtype}"
        )
    return k_shard


def check_slots(kernel: str, local_slots: object) -> torch.Tensor:
    """Check ``local_slots``: 1-D contiguous int64.

    Raises:
        ValueError: naming the offending shape, dtype or strides.
    """
    return check_tensor(
        kernel, "local_slots", local_slots, ndim=1, dtypes=(torch.int64,), contiguous=True
    )


_BITS_DTYPE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as the int dtype of its element size: copies are bit-exact, and fp16 and bf16
    share one compiled kernel."""
    return t.view(_BITS_DTYPE[t.element_size()])
