"""What a step tells the lanes and what each lane answers (torch-free, so the coordinator
builds and the client reads them without torch).

One :class:`StepRequest` goes to every lane; each lane derives its own share from the
request's :class:`StepSequence` list (``cpkv.lanes.step.StepPlan.build``) and answers a
:class:`StepResult`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cpkv.core.validate import check_int
from cpkv.errors import InvalidRequestError

__all__ = [
    "MODES",
    "LaneReply",
    "StepPacket",
    "StepRequest",
    "StepResult",
    "StepSequence",
    "check_mode",
    "group_id",
    "superseded",
]

#: Attention exchanges a step can use (``auto`` picks one per step).
MODES = ("auto", "pass_q", "pass_kv")


def group_id(epoch: str, number: int) -> str:
    """The id of the coordinator's ``number``-th lane group (they are built one at a time)."""
    return f"{epoch[:8]}:g{number}"


def superseded(ident: str, by: str | None) -> bool:
    """Whether ``ident`` was replaced by ``by``, a later one of the same coordinator: for lane
    generations (``"{epoch}:{n}"``) and lane groups (:func:`group_id`). ``False`` when they
    cannot be ordered (another coordinator's, or ``None``)."""
    if by is None:
        return False
    (owner, n), (by_owner, by_n) = _numbered(ident), _numbered(by)
    return owner == by_owner and n is not None and by_n is not None and by_n > n


def _numbered(ident: str) -> tuple[str, int | None]:
    owner, _, tail = ident.rpartition(":")
    digits = tail.lstrip("g")
    return owner, int(digits) if digits.isdigit() else None


def check_mode(mode: object, name: str = "mode") -> str:
    """Return ``mode`` when it is one of :data:`MODES` (the one check of every layer).

    Raises:
        InvalidRequestError: any other value, naming the argument and the modes.
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise InvalidRequestError(f"{name}={mode!r}; expected one of {MODES}")
    return mode


@dataclass(slots=True, frozen=True, eq=False)
class StepSequence:
    """One request's part of a step.

    Attributes:
        prefix_len: tokens the sequence held before this step (already in the shards; its
            new tokens start at this position).
        extend_len: new tokens of this step (``>= 1``; 1 for decode).
        pages: ``int32 [ceil((prefix_len + extend_len) / page_size)]`` global page ids of the
            whole sequence after the step, in position order (read-only copy).
        token_ids: ``int64 [extend_len]`` the new tokens (``None``: a step without a model).
        rid: the request (for messages only).
        probe_start: row of the step's probe tensors holding this sequence's first new token.

    Raises:
        ValueError: (``InvalidRequestError`` for the lengths) a length that is not an integer,
            ``prefix_len < 0``, ``extend_len < 1``, ``pages`` not a 1-D integer array, a
            negative page id, or ``token_ids`` that are not ``extend_len`` ids. The page count
            and the reserved pages are checked by ``StepPlan.build``, which knows
            ``page_size`` and ``cp_size``.
    """

    prefix_len: int
    extend_len: int
    pages: np.ndarray
    token_ids: np.ndarray | None = None
    rid: Hashable = None
    probe_start: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_len", check_int("prefix_len", self.prefix_len, minimum=0))
        object.__setattr__(self, "extend_len", check_int("extend_len", self.extend_len, minimum=1))
        object.__setattr__(
            self, "probe_start", check_int("probe_start", self.probe_start, minimum=0)
        )
        pages = np.asarray(self.pages)
        if pages.ndim != 1:
            raise ValueError(f"pages must be 1-D, got shape {pages.shape}")
        if pages.size:
            dtype = pages.dtype
            if dtype.kind not in "iu":  # bools are kind "b"
                raise ValueError(f"pages must hold integers, got dtype {dtype}")
            # NOTE: only the reductions a dtype needs (a step builds one sequence per request).
            if dtype.kind == "i" and int(pages.min()) < 0:
                raise ValueError(f"pages holds a negative page id {int(pages.min())}")
            wide = dtype.itemsize > 4 or (dtype.kind == "u" and dtype.itemsize == 4)
            if wide and int(pages.max()) > np.iinfo(np.int32).max:
                raise ValueError(f"pages holds page id {int(pages.max())} beyond int32")
        pages = pages.astype(np.int32, copy=True)
        pages.setflags(write=False)
        object.__setattr__(self, "pages", pages)
        if self.token_ids is not None:
            # NOTE: ids reach here int64 from the client's edge: no copy then.
            ids = np.asarray(self.token_ids, dtype=np.int64)
            if ids.shape != (self.extend_len,):
                raise ValueError(
                    f"token_ids has shape {ids.shape}, expected ({self.extend_len},) "
                    f"(extend_len={self.extend_len})"
                )
            object.__setattr__(self, "token_ids", ids)

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence after the step."""
        return self.prefix_len + self.extend_len


@dataclass(slots=True, frozen=True, eq=False)
class StepRequest:
    """A prefill or decode step: one Ray call per lane carries this same object.

    Attributes:
        step_id: the coordinator's step counter (lanes check they run steps in order).
        group: the lane group's generation the step expects (rebuilt after a lane restart).
        sequences: the step's requests, in order (at least one).
        mode: ``auto``, ``pass_q`` or ``pass_kv`` (attention exchange; see :func:`check_mode`).
        probe: for tests and benchmarks without a model: ``(q, k, v)``, ``[R, Hq, D]``,
            ``[R, Hkv, D]``, ``[R, Hkv, D]``, rows as the caller gave tokens (a sequence's new
            tokens from its ``probe_start``); each lane attends its own tokens (layer 0) and
            returns their outputs.
        sample: the lanes answer each sequence's greedy next token instead of its logits
            (only ids leave the devices).
    """

    step_id: int
    group: str
    sequences: tuple[StepSequence, ...]
    mode: str = "auto"
    probe: tuple | None = None
    sample: bool = False

    def __post_init__(self) -> None:
        # NOTE: the coordinator checked the mode (check_mode) before deciding the step.
        assert self.mode in MODES, self.mode
        assert self.sequences, "a step needs at least one sequence"

    @property
    def token_ids(self) -> np.ndarray:
        """``int64 [T]`` the new tokens of every sequence, in step order.

        Raises:
            ValueError: a sequence has no token ids (a step of a pool without a model).
        """
        if any(s.token_ids is None for s in self.sequences):
            raise ValueError(f"step {self.step_id}: a model step needs every sequence's token ids")
        return np.concatenate([s.token_ids for s in self.sequences])

    @property
    def probe_rows(self) -> np.ndarray:
        """``int64 [T]`` for each step token, its row in the probe tensors."""
        return np.concatenate(
            [np.arange(s.probe_start, s.probe_start + s.extend_len) for s in self.sequences]
        )


@dataclass(slots=True, frozen=True, eq=False)
class StepResult:
    """One lane's answer to a step.

    Attributes:
        num_tokens: step tokens this lane computed.
        compute_s: seconds the lane spent on the step.
        wait_s: of which in the lanes' collectives.
        attention_s: of which in CP attention (its collectives included).
        mode: the attention exchange the step used (``pass_q`` or ``pass_kv``; for a step
            whose pages all lie on one lane, which exchanges nothing, the mode asked for,
            ``pass_q`` under ``auto``).
        exchange_bytes: bytes this lane sent in the attention exchanges.
        logits: ``{b: [vocab] np.ndarray}`` for the sequences ``b`` whose last new token
            this lane computed (model steps), as :attr:`logits_dtype` says
            (:func:`cpkv.results.widen_logits` makes them fp32).
        out: probe steps: ``fp32 [num_tokens, Hq, D]`` attention outputs of this lane's tokens
            (a CPU ``torch.Tensor``); ``None`` otherwise.
        tokens: probe steps: ``int64 [num_tokens]`` the step indices of those rows.
        next_tokens: sampling steps: ``{b: id}`` the greedy next token of the sequences whose
            last new token this lane computed (``logits`` is then empty).
        graph: the step replayed a recorded CUDA graph (``attention_s`` is then 0: a graph's
            sections are not timed apart).
        logits_dtype: how the ``logits`` rows travel: ``"float32"``, ``"float16"``, or
            ``"bfloat16"`` (the raw bits, ``uint16``). The model computes its logits in its
            own dtype, so the 16-bit rows lose nothing and halve the step's largest payload.
    """

    num_tokens: int
    compute_s: float
    wait_s: float
    attention_s: float
    mode: str
    exchange_bytes: int
    logits: dict[int, Any] = field(default_factory=dict)
    out: Any = None
    tokens: np.ndarray | None = None
    next_tokens: dict[int, int] = field(default_factory=dict)
    graph: bool = False
    logits_dtype: str = "float32"


@dataclass(slots=True, frozen=True, eq=False)
class StepPacket:
    """One step as a compiled dispatch sends it: the same object reaches every lane.

    Attributes:
        step: the step (``None``: a warm-up that only says whose graph the lane serves).
        moves: per lane, the page moves riding in the step (a tuple of
            ``LaneShard.apply``'s arguments) or ``None``.
        fences: per lane ``(generation, seq)``: the moves the lane must have applied, through
            its ordinary calls, before this step's own (which it waits for: the step does not
            travel behind them).
        epoch: the coordinator that sent it.
    """

    step: StepRequest | None
    moves: tuple = ()
    fences: tuple = ()
    epoch: str = ""


@dataclass(slots=True, frozen=True, eq=False)
class LaneReply:
    """A lane's answer that came back as a value (through the coordinator) instead of a Ray
    handle: what the call returned, or the error it raised.

    Attributes:
        value: the result (when ``error`` is ``None``).
        error: the exception the call raised.
    """

    value: Any = None
    error: BaseException | None = None

    def unwrap(self) -> Any:
        """The value. Raises: the call's error."""
        if self.error is not None:
            raise self.error
        return self.value
