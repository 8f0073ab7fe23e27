"""The ``iterserve`` command line: ``serve`` and ``run-batch`` (the cluster's,
with vLLM's flags), ``bench`` and ``simulate`` (the benchmarks'). It lives above
both so that the cluster never imports the benchmarks."""

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
    from iterserve.bench.forward import bench_forward

    if not (args.architectures or args.moe):
        _write(bench_forward(args.model, num_threads=args.threads), args.json)
        return
    import torch

    from iterserve.bench import architectures

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = {}
    if args.architectures:
        result["vs_llama"] = architectures.compare_architectures()
    if args.moe:
        result["moe_experts_used"] = architectures.moe_experts_used()
    _write(result, args.json)


def _bench_overhead(args: argparse.Namespace) -> None:
    from iterserve.bench import engine_bench

    _write(engine_bench.overhead(), args.json)


def _bench_ceiling(args: argparse.Namespace) -> None:
    from iterserve.bench import engine_bench

    _write(engine_bench.ceiling(args.model, num_seqs=args.num_seqs), args.json)


def _bench_structured(args: argparse.Namespace) -> None:
    from iterserve.bench import structured_bench

    result = structured_bench.structured_cost(
        args.model, num_seqs=args.num_seqs, max_tokens=args.max_tokens, rounds=args.rounds
    )
    _write(result, args.json)


def _simulate(args: argparse.Namespace) -> None:
    from iterserve.bench import simulator

    extra = {}
    if args.workload == "speculative":
        extra = dict(acceptance=args.acceptance, num_speculative_tokens=args.num_speculative_tokens,
                     disable_by_batch_size=args.disable_by_batch_size)  # fmt: skip
    result = simulator.run(
        args.gpu, args.model, json_path=args.json, workload=args.workload, **extra
    )
    print(json.dumps(result, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    # serve and run-batch parse their own flags (vLLM's): main hands them their arguments.
    commands.add_parser(
        "serve", add_help=False, help="the OpenAI-compatible server (default: the demo model)"
    )
    commands.add_parser(
        "run-batch", add_help=False, help="an OpenAI batch file through the offline engine"
    )

    bench = commands.add_parser("bench", help="benchmarks that print ratios; they never assert")
    benches = bench.add_subparsers(dest="bench", required=True)
    sched = benches.add_parser("scheduler", help="CPU ms of schedule()+update() per step")
    sched.add_argument("--json", help="also write the result to this file")
    sched.set_defaults(func=_bench_scheduler)
    forward = benches.add_parser("forward", help="model forward tokens/s on this machine")
    forward.add_argument("--model", help="checkpoint directory (default: the demo model)")
    forward.add_argument("--json", help="also write the result to this file")
    forward.add_argument("--threads", type=int, default=None, help="torch threads")
    forward.add_argument(
        "--architectures",
        action="store_true",
        help="each architecture's tokens/s over a Llama's of the same shape",
    )
    forward.add_argument(
        "--moe", action="store_true", help="an MoE step's time by the experts it uses"
    )
    forward.set_defaults(func=_bench_forward)
    overhead = benches.add_parser("overhead", help="control-plane ms per step through Ray")
    overhead.add_argument("--json", help="also write the result to this file")
    overhead.set_defaults(func=_bench_overhead)
    ceiling = benches.add_parser("ceiling", help="engine tok/s through Ray vs the bare runner")
    ceiling.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ceiling.add_argument("--num-seqs", type=int, default=16)
    ceiling.add_argument("--json", help="also write the result to this file")
    ceiling.set_defaults(func=_bench_ceiling)

    structured = benches.add_parser(
        "structured", help="decode tok/s, half the batch under a JSON schema ÷ none"
    )
    structured.add_argument("--model", help="checkpoint directory (default: the demo model)")
    structured.add_argument("--num-seqs", type=int, default=16)
    structured.add_argument("--max-tokens", type=int, default=64)
    structured.add_argument("--rounds", type=int, default=5)
    structured.add_argument("--json", help="also write the result to this file")
    structured.set_defaults(func=_bench_structured)

    from iterserve.bench import (
        agreement,
        compare,
        fairness,
        kv_tiers,
        loadgen,
        lora,
        policies,
        prefix,
        ramp,
        shapes,
        speculative,
    )

    loadgen.register(benches)
    lora.register(benches)
    policies.register(benches)
    fairness.register(benches)
    prefix.register(benches)
    kv_tiers.register(benches)
    compare.register(benches)
    shapes.register(benches)
    agreement.register(benches)
    ramp.register(benches)
    speculative.register(benches)

    simulate = commands.add_parser(
        "simulate", help="the real scheduler on a virtual clock with a GPU roofline cost model"
    )
    simulate.add_argument("--gpu", choices=["h100", "h200"], default="h200")
    simulate.add_argument("--model", choices=["8b", "70b"], default="8b")
    simulate.add_argument(
        "--workload",
        choices=["longtail", "shared-prefix", "speculative", "fairness"],
        default="longtail",
        help="longtail: every policy; shared-prefix: chunked with the prefix cache off and "
        "on; speculative: decode speed with prompt-lookup proposals ÷ without, by concurrency; "
        "fairness: a flood tenant against light ones under each scheduling_policy",
    )
    simulate.add_argument(
        "--acceptance", type=float, default=0.7, help="speculative: each proposal's chance"
    )
    simulate.add_argument("--num-speculative-tokens", type=int, default=4, help="speculative")
    simulate.add_argument(
        "--disable-by-batch-size", type=int, help="speculative (default: the engine's)"
    )
    simulate.add_argument("--json", help="also write the result to this file")
    simulate.set_defaults(func=_simulate)
    return parser


OWN_PARSERS = {"serve": "cli", "run-batch": "batch"}  # modules of iterserve.cluster.serve


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_PARSERS:
        import importlib

        module = importlib.import_module(f"iterserve.cluster.serve.{OWN_PARSERS[argv[0]]}")
        return module.main(argv[1:], prog=f"iterserve {argv[0]}")
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
