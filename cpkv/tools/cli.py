"""The ``cpkv`` command: ``cpkv demo`` and ``cpkv bench``."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence

__all__ = ["main"]


def _setup_logging() -> None:
    level = os.environ.get("CPKV_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _tokens(text: str) -> int:
    """``32k`` -> 32768, ``1M`` -> 1048576, ``1000`` -> 1000."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _int_at_least(low: int):
    """An argparse type: an int ``>= low`` (0 or a negative size would quietly become a
    default, or fail deep inside the run)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return value


def _non_negative_float(text: str) -> float:
    """An argparse type: a finite float ``>= 0`` (``--num-gpus-per-lane 0``: CPU lanes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def _contexts(text: str) -> list[int]:
    """``32k,128k`` -> [32768, 131072]: context lengths in tokens, each at least 1."""
    values = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            value = _tokens(x)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"{x!r} is not a token count (1000, 32k, 1M)"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{x!r} is {value} tokens; must be >= 1")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no context length")
    return values


def _address(text: str) -> str | None:
    """``--address``: ``local`` is the embedded Ray (as no ``--address``), kept on loopback;
    anything else as :func:`cpkv.actors.ray_env.check_address` allows."""
    text = text.strip()
    if text == "local":
        return None
    if not text:
        raise argparse.ArgumentTypeError("empty; pass 'auto', ray://host:port or host:port")
    return text


class _LazyChoices(Sequence):
    """``choices=`` read from the module that validates them, imported on first use only
    (``cpkv.actors.pool`` imports Ray, ``cpkv.models`` torch: not for ``cpkv --help``'s
    usage line). Pass a ``metavar`` with it, or argparse lists the choices at once."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load
        self._values: tuple[str, ...] | None = None

    def _get(self) -> tuple[str, ...]:
        if self._values is None:
            self._values = tuple(self._load())
        return self._values

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __contains__(self, value: object) -> bool:
        return value in self._get()


def _strategies() -> Sequence[str]:
    from cpkv.actors.pool import STRATEGIES

    return STRATEGIES


def _modes() -> Sequence[str]:
    from cpkv.core.steps import MODES

    return MODES


def _dtypes() -> Sequence[str]:
    from cpkv.models.config import DTYPES

    return DTYPES


def _ints(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]: lane counts, each at least 1, at least one."""
    values = [_int_at_least(1)(x) for x in text.split(",") if x]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no lane count")
    return values


def _add_run_arguments(p: argparse.ArgumentParser, *, page_size: int) -> None:
    """The arguments every command shares: where the lanes run and how the run looks."""
    g = p.add_argument_group("pool and run")
    g.add_argument("--page-size", type=_int_at_least(1), default=page_size)
    g.add_argument(
        "--address",
        type=_address,
        default=None,
        help="'auto', ray://host:port or host:port; default (or 'local'): embedded Ray",
    )
    g.add_argument("--num-gpus-per-lane", type=_non_negative_float, default=None)
    g.add_argument(
        "--seed", type=_int_at_least(0), default=0, help="random weights' and prompts' seed"
    )
    g.add_argument("--no-progress", action="store_true")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpkv", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "demo",
        help="a small Llama on the lanes: shared-prefix prompts in chunks under pool pressure, "
        "decode, every request's logits checked against one device",
    )
    d.add_argument(
        "--model", default=None, metavar="DIR", help="a local checkpoint (default: random weights)"
    )
    d.add_argument("--cp-size", type=_int_at_least(1), default=4)
    d.add_argument("--prompts", type=_int_at_least(1), default=24)
    d.add_argument("--workers", type=_int_at_least(1), default=4)
    d.add_argument("--decode-tokens", type=_int_at_least(0), default=3)
    d.add_argument(
        "--pages-per-lane",
        type=_int_at_least(2),
        default=None,
        help="default: sized for pool pressure",
    )
    _add_run_arguments(d, page_size=16)
    b = sub.add_parser(
        "bench",
        help="allocation scaling over lanes and context lengths; --prefill: prefill time on "
        "the lanes per cp_size, zigzag vs contiguous owner split",
    )
    b.add_argument(
        "--prefill",
        action="store_true",
        help="time a model's prefill on the lanes (default: allocation only)",
    )
    b.add_argument("--lanes", type=_ints, default=None, help="default 1,2,4,8 (--prefill: 1,2,4)")
    b.add_argument(
        "--context",
        type=_contexts,
        default=None,
        help="default 32k,128k (--prefill: 2k,4k; pass 32k on GPUs)",
    )
    b.add_argument(
        "--requests", type=_int_at_least(1), default=None, help="default 8 (--prefill: 3)"
    )
    # NOTE: the mode-only flags default to None, so that one given to the other mode is
    # told apart from its default and refused (see _PREFILL_ONLY).
    b.add_argument(
        "--concurrency",
        type=_int_at_least(1),
        default=None,
        help="allocation bench threads (default 2; not with --prefill)",
    )
    b.add_argument(
        "--model",
        default=None,
        help="--prefill: a checkpoint DIR or random weights of a preset: small (default), "
        "tiny, llama-3.2-1b",
    )
    b.add_argument(
        "--dtype",
        choices=_LazyChoices(_dtypes),
        metavar="DTYPE",
        default=None,
        help="--prefill: run the model in this dtype: %(choices)s",
    )
    b.add_argument(
        "--attention-mode",
        choices=_LazyChoices(_modes),
        metavar="MODE",
        default=None,
        help="--prefill: %(choices)s (default auto)",
    )
    b.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=None,
        help="--prefill: link rate (GB/s, one way) of the one-GPU-per-lane projection "
        "(default: NVLink-class 450)",
    )
    b.add_argument(
        "--strategy",
        choices=_LazyChoices(_strategies),
        metavar="STRATEGY",
        default="STRICT_PACK",
        help="lane placement: %(choices)s (default %(default)s)",
    )
    b.add_argument("--out", default="results")
    b.add_argument("--no-plot", action="store_true")
    _add_run_arguments(b, page_size=64)
    return p


# ``cpkv bench`` flags that only ``--prefill`` reads (dest -> flag).
_PREFILL_ONLY = {
    "model": "--model",
    "dtype": "--dtype",
    "attention_mode": "--attention-mode",
    "link_gbps": "--link-gbps",
}


def _check_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``cpkv bench`` flags its mode ignores, and a placement the embedded Ray cannot
    give (it waited for the placement group for minutes, then timed out)."""
    if args.prefill:
        if args.concurrency is not None:
            parser.error("--concurrency: the allocation bench's threads; not with --prefill")
    else:
        for dest, flag in _PREFILL_ONLY.items():
            if getattr(args, dest) is not None:
                parser.error(f"{flag} is read by --prefill only; add --prefill or drop it")
    lanes = args.lanes or ([1, 2, 4] if args.prefill else [1, 2, 4, 8])
    if args.address is None and args.strategy == "STRICT_SPREAD" and max(lanes) >= 2:
        parser.error(
            f"--strategy STRICT_SPREAD puts each lane on a node of its own, and the embedded "
            f"Ray (no --address) has one node: --lanes {','.join(map(str, lanes))} cannot "
            "be placed; pass --address of a cluster with enough nodes, --lanes 1, or another "
            "--strategy"
        )


def _check_demo(parser: argparse.ArgumentParser, cfg) -> None:
    """Refuse ``--pages-per-lane`` too small for the demo's longest request alone (it
    retried capacity waits for minutes, then failed)."""
    if cfg.num_pages_per_lane is None:
        return
    from cpkv.core.layout import PageLayout
    from cpkv.tools.demo import lane_pages_for, longest_request

    layout = PageLayout(cfg.cp_size, cfg.page_size)
    longest = longest_request(cfg)
    needed = lane_pages_for(layout, layout.pages_for(longest))
    if cfg.num_pages_per_lane < needed:
        parser.error(
            f"--pages-per-lane {cfg.num_pages_per_lane}: the longest request ({longest} "
            f"tokens, {layout.pages_for(longest)} pages of {cfg.page_size} over "
            f"{cfg.cp_size} lane(s)) needs at least {needed} pages per lane"
        )


def _bench_config(args: argparse.Namespace):
    """The :class:`BenchConfig`, or with ``--prefill`` the :class:`PrefillBenchConfig`, of
    the parsed ``cpkv bench`` arguments."""
    from cpkv.tools.bench import BenchConfig, PrefillBenchConfig

    common = dict(
        page_size=args.page_size,
        address=args.address,
        strategy=args.strategy,
        num_gpus_per_lane=args.num_gpus_per_lane,
        out_dir=args.out,
        progress=not args.no_progress,
        plot=not args.no_plot,
        seed=args.seed,
    )
    if args.prefill:
        return PrefillBenchConfig(
            lanes=[1, 2, 4] if args.lanes is None else args.lanes,
            contexts=args.context,
            requests=3 if args.requests is None else args.requests,
            model="small" if args.model is None else args.model,
            dtype=args.dtype,
            attention_mode="auto" if args.attention_mode is None else args.attention_mode,
            **({} if args.link_gbps is None else {"link_gb_per_s": args.link_gbps}),
            **common,
        )
    return BenchConfig(
        lanes=[1, 2, 4, 8] if args.lanes is None else args.lanes,
        contexts=args.context or [32 << 10, 128 << 10],
        requests=8 if args.requests is None else args.requests,
        concurrency=2 if args.concurrency is None else args.concurrency,
        **common,
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd == "bench":
        _check_bench(parser, args)
    model = (
        args.model if args.cmd == "demo" else ((args.model or "small") if args.prefill else None)
    )
    if model is not None and not os.path.isdir(model):
        from cpkv.models import MODEL_PRESETS

        if args.cmd == "demo" or model not in MODEL_PRESETS:
            presets = "" if args.cmd == "demo" else f" or a preset ({', '.join(MODEL_PRESETS)})"
            parser.error(f"--model {model!r}: not a checkpoint directory{presets}")
    demo_cfg = None
    if args.cmd == "demo":
        from cpkv.tools.demo import DemoConfig

        demo_cfg = DemoConfig(
            cp_size=args.cp_size,
            page_size=args.page_size,
            num_pages_per_lane=args.pages_per_lane,
            num_prompts=args.prompts,
            decode_tokens=args.decode_tokens,
            workers=args.workers,
            model_dir=args.model,
            seed=args.seed,
            address=args.address,
            num_gpus_per_lane=args.num_gpus_per_lane,
            progress=not args.no_progress,
        )
        _check_demo(parser, demo_cfg)
    _setup_logging()
    if args.address is None:
        from cpkv.actors.ray_env import keep_ray_on_loopback

        keep_ray_on_loopback()
    if demo_cfg is not None:
        from cpkv.tools.demo import run_demo

        return run_demo(demo_cfg)
    from cpkv.tools.bench import PrefillBenchConfig, run_bench, run_prefill_bench

    cfg = _bench_config(args)
    if isinstance(cfg, PrefillBenchConfig):
        run_prefill_bench(cfg)
    else:
        run_bench(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
