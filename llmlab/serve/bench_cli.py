"""``llmlab bench serve``: offline (the engine against Hugging Face, :mod:`llmlab.inference.bench`)
or, with ``--endpoint URL``, over HTTP against a running server (:mod:`llmlab.serve.load_test`).

    llmlab bench serve --model shakespeare --baseline hf              # offline, in this process
    llmlab serve --port 8000 &
    llmlab bench serve --endpoint http://127.0.0.1:8000 --request-rate 2,8,inf \\
                       --slo-ttft 0.5 --slo-tpot 0.05 --json out.json
"""

from __future__ import annotations

import argparse
import json

from llmlab.inference import bench


def _rates(text: str):
    from llmlab.serve.load_test import parse_rates

    try:
        return parse_rates(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    bench.add_arguments(p)
    rate = p._option_string_actions["--request-rate"]  # one flag for both modes: R[,R...]
    rate.type = _rates
    rate.help = (
        "Poisson arrivals, requests/s; with --endpoint a comma list, one run each "
        "(inf: all at once; default: offline, all at t=0)"
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write the results as TensorBoard scalars to DIR",
    )
    g = p.add_argument_group("over HTTP (--endpoint)")
    g.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="benchmark the OpenAI-compatible server at URL (e.g. http://127.0.0.1:8000)",
    )
    g.add_argument("--served-model", default=None, help="model id to send (default: the server's)")
    g.add_argument("--api-key", default=None, help="bearer token for the server")
    g.add_argument("--slo-ttft", type=float, default=None, metavar="S", help="goodput SLO on TTFT, s")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="S", help="goodput SLO on TPOT, s")


def run(args) -> int:
    rates = args.request_rate
    if args.tensorboard:
        from llmlab.metrics.profiling import check_dir

        check_dir(args.tensorboard, "--tensorboard")
    if args.endpoint is None:
        if args.slo_ttft is not None or args.slo_tpot is not None:
            raise ValueError("--slo-ttft/--slo-tpot need --endpoint")
        if rates is not None and len(rates) > 1:
            raise ValueError("several --request-rate values need --endpoint (one offline run takes one)")
        args.request_rate = None if rates is None else rates[0]
        return bench.run(args)
    from llmlab.serve.load_test import bench_endpoint, print_table

    res = bench_endpoint(
        args.endpoint,
        rates or [float("inf")],
        num_requests=args.num_requests,
        seed=args.seed,
        model=args.served_model,
        api_key=args.api_key,
        slo_ttft=args.slo_ttft,
        slo_tpot=args.slo_tpot,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        length_sigma=args.length_sigma,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.tensorboard:
        from llmlab.metrics.tensorboard import write_bench

        write_bench(res["rates"], args.tensorboard)
    print_table(res)
    return 0
