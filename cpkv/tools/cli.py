"""The ``cpkv`` command: ``cpkv demo`` and ``cpkv bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

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
    g.add_argument("--address", default=None, help="'auto' or ray://...; default: embedded Ray")
    g.add_argument("--num-gpus-per-lane", type=float, default=None)
    g.add_argument("--seed", type=int, default=0, help="random weights' and prompts' seed")
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
        type=lambda s: [_tokens(x) for x in s.split(",")],
        default=None,
        help="default 32k,128k (--prefill: 2k,4k; pass 32k on GPUs)",
    )
    b.add_argument(
        "--requests", type=_int_at_least(1), default=None, help="default 8 (--prefill: 3)"
    )
    b.add_argument(
        "--concurrency", type=_int_at_least(1), default=2, help="allocation bench threads"
    )
    b.add_argument(
        "--model",
        default="small",
        help="--prefill: a checkpoint DIR or random weights of a preset: small (default), "
        "tiny, llama-3.2-1b",
    )
    b.add_argument("--dtype", default=None, help="--prefill: run the model in this dtype")
    b.add_argument("--attention-mode", default="auto", help="--prefill: auto, pass_q or pass_kv")
    b.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=None,
        help="--prefill: link rate (GB/s, one way) of the one-GPU-per-lane projection "
        "(default: NVLink-class 450)",
    )
    b.add_argument("--strategy", default="STRICT_PACK")
    b.add_argument("--out", default="results")
    b.add_argument("--no-plot", action="store_true")
    _add_run_arguments(b, page_size=64)
    return p


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
            model=args.model,
            dtype=args.dtype,
            attention_mode=args.attention_mode,
            **({} if args.link_gbps is None else {"link_gb_per_s": args.link_gbps}),
            **common,
        )
    return BenchConfig(
        lanes=[1, 2, 4, 8] if args.lanes is None else args.lanes,
        contexts=args.context or [32 << 10, 128 << 10],
        requests=8 if args.requests is None else args.requests,
        concurrency=args.concurrency,
        **common,
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    model = args.model if args.cmd == "demo" else (args.model if args.prefill else None)
    if model is not None and not os.path.isdir(model):
        from cpkv.models import MODEL_PRESETS

        if args.cmd == "demo" or model not in MODEL_PRESETS:
            presets = "" if args.cmd == "demo" else f" or a preset ({', '.join(MODEL_PRESETS)})"
            parser.error(f"--model {model!r}: not a checkpoint directory{presets}")
    _setup_logging()
    if args.address is None:
        from cpkv.actors.ray_env import keep_ray_on_loopback

        keep_ray_on_loopback()
    if args.cmd == "demo":
        from cpkv.tools.demo import DemoConfig, run_demo

        cfg = DemoConfig(
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
        return run_demo(cfg)
    from cpkv.tools.bench import PrefillBenchConfig, run_bench, run_prefill_bench

    cfg = _bench_config(args)
    if isinstance(cfg, PrefillBenchConfig):
        run_prefill_bench(cfg)
    else:
        run_bench(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
