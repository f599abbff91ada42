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


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


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
    d.add_argument("--cp-size", type=int, default=4)
    d.add_argument("--prompts", type=int, default=24)
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--seed", type=int, default=0, help="random weights' and prompts' seed")
    d.add_argument("--decode-tokens", type=int, default=3)
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument(
        "--pages-per-lane", type=int, default=None, help="default: sized for pool pressure"
    )
    d.add_argument("--address", default=None, help="'auto' or ray://...; default: embedded Ray")
    d.add_argument("--num-gpus-per-lane", type=float, default=None)
    d.add_argument("--no-progress", action="store_true")
    b = sub.add_parser("bench", help="allocation scaling over lanes and context lengths")
    b.add_argument("--lanes", type=_ints, default=[1, 2, 4, 8])
    b.add_argument(
        "--context",
        type=lambda s: [_tokens(x) for x in s.split(",")],
        default=[32 << 10, 128 << 10],
    )
    b.add_argument("--requests", type=int, default=8)
    b.add_argument("--page-size", type=int, default=64)
    b.add_argument("--concurrency", type=int, default=2)
    b.add_argument("--address", default=None)
    b.add_argument("--strategy", default="STRICT_PACK")
    b.add_argument("--num-gpus-per-lane", type=float, default=None)
    b.add_argument("--out", default="results")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    if args.address is None:
        from cpkv._ray_env import keep_ray_on_loopback

        keep_ray_on_loopback()
    if args.cmd == "demo":
        from cpkv.demo import DemoConfig, run_demo

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
    from cpkv.bench import BenchConfig, run_bench

    cfg = BenchConfig(
        lanes=args.lanes,
        contexts=args.context,
        requests=args.requests,
        page_size=args.page_size,
        concurrency=args.concurrency,
        address=args.address,
        strategy=args.strategy,
        num_gpus_per_lane=args.num_gpus_per_lane,
        out_dir=args.out,
        progress=not args.no_progress,
        plot=not args.no_plot,
    )
    run_bench(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
