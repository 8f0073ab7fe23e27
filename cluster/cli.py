"""The ``iterserve`` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _write(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def _bench_scheduler(args: argparse.Namespace) -> None:
    from iterserve.bench import scheduler_bench

    _write(scheduler_bench.run(), args.json)


def _bench_forward(args: argparse.Namespace) -> None:
    from iterserve.workers.bench_forward import bench_forward

    _write(bench_forward(args.model), args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks that print ratios; they never assert")
    benches = bench.add_subparsers(dest="bench", required=True)
    sched = benches.add_parser("scheduler", help="CPU ms of schedule()+update() per step")
    sched.add_argument("--json", help="also write the result to this file")
    sched.set_defaults(func=_bench_scheduler)
    forward = benches.add_parser("forward", help="model forward tokens/s on this machine")
    forward.add_argument("--model", help="checkpoint directory (default: the demo model)")
    forward.add_argument("--json", help="also write the result to this file")
    forward.set_defaults(func=_bench_forward)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
