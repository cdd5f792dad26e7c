"""``llmlab generate``: offline generation with the paged-KV-cache engine (see CONTRACT.md).

    llmlab generate --prompt "ROMEO:"                         # the shipped shakespeare model
    llmlab generate --model DIR --prompts-file in.jsonl --temperature 0 --output out.jsonl

``in.jsonl``: one request per line, ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``, with
optional sampling fields (:data:`PER_REQUEST`, names of ``SamplingParams``).
``out.jsonl``: one line per request in input order: ``index``, ``prompt_token_ids``,
``token_ids``, ``text`` (null without a tokenizer), ``finish_reason`` (``length``/``stop``/
``error``), ``error`` (the message, or null), ``sampling_defaults`` (the fields the checkpoint's
generation config filled), when requested ``logprobs`` and ``prompt_logprobs`` (null for the
first prompt token) and, for ``n`` > 1, ``outputs`` (one
``token_ids``/``text``/``finish_reason`` per sample; the top-level fields are the first sample's).

Sampling fields: a request's own value, else the flag's, else the checkpoint's
``generation_config.json``, else the CLI's default (temperature 0.8, max_tokens 128). A bad
request (unreadable line, empty prompt, bad parameters, too long) gets an ``error`` line; the
others still run; the exit status is then 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from llmlab.inference.engine_config import add_engine_arguments, field_names, from_args

if TYPE_CHECKING:
    from llmlab.inference.outputs import Logprob, RequestOutput
    from llmlab.inference.sampling import SamplingParams

PER_REQUEST = (
    "n",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
    "logit_bias",
)
CLI_DEFAULTS = {"temperature": 0.8, "max_tokens": 128}  # after the generation config
# The engine flags: EngineConfig's fields, less the engine seed (``--seed`` here seeds the requests).
ENGINE_FLAGS = [n for n in field_names() if n != "seed"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="shakespeare",
        help="checkpoint directory (HF Llama/Qwen2 or llmlab) or a preset with shipped "
        "weights (default: shakespeare, bundled)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT", help="prompt text(s)")
    src.add_argument("--prompts-file", metavar="IN.jsonl", help="one JSON request per line")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate per request (default: the checkpoint's, else 128)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: the checkpoint's, else 0.8; 0 = greedy (the tokens Hugging Face "
        "generate(do_sample=False) gives)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample among the k most likely tokens (default: the checkpoint's, else 0 = all tokens)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: keep the most likely tokens up to this probability mass "
        "(default: the checkpoint's, else 1 = all)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=None,
        help="drop tokens less likely than this fraction of the most likely one "
        "(default: the checkpoint's, else 0 = off)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="divides the logits of tokens already in prompt or output (> 1 repeats "
        "less; default: the checkpoint's, else 1 = off)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=None,
        help="subtracted from the logits of tokens already generated (default: 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=None,
        help="subtracted once per time a token was generated (default: 0)",
    )
    p.add_argument(
        "--logprobs", type=int, default=None, help="top log-probabilities per token (default: none)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (request i uses seed + i)")
    p.add_argument("--stop", nargs="+", action="extend", default=None, metavar="S", help="stop strings")
    add_engine_arguments(
        p,
        ENGINE_FLAGS,
        {
            "tensor_parallel_size": {
                "help": "ranks the model is sharded over (spawned here, or the ranks torchrun started)"
            }
        },
    )
    p.add_argument("--output", metavar="OUT.jsonl", default=None, help="write results as JSONL")


def read_requests(args: argparse.Namespace) -> list[dict[str, Any] | str]:
    """The requests in order: a dict per request, or a ``str`` error for a line that is not one."""
    if args.prompt:
        return [{"prompt": t} for t in args.prompt]
    reqs: list[dict[str, Any] | str] = []
    with open(args.prompts_file) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                reqs.append(f"{args.prompts_file}:{n}: not valid JSON ({e.msg})")
                continue
            if not isinstance(r, dict) or not ("prompt" in r or "prompt_token_ids" in r):
                reqs.append(f"{args.prompts_file}:{n}: needs 'prompt' or 'prompt_token_ids'")
                continue
            if "prompt" in r and not isinstance(r["prompt"], str):
                reqs.append(f"{args.prompts_file}:{n}: 'prompt' must be a string")
                continue
            ids = r.get("prompt_token_ids", [])
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                reqs.append(f"{args.prompts_file}:{n}: 'prompt_token_ids' must be a list of integers")
                continue
            reqs.append(r)
    if not reqs:
        raise ValueError(f"{args.prompts_file} holds no requests")
    return reqs


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The JSON type each per-request field must have (JSON numbers: 1 is a valid float).
FIELD_TYPES = {
    "n": "int",
    "max_tokens": "int",
    "top_k": "int",
    "seed": "int",
    "min_tokens": "int",
    "logprobs": "int",
    "temperature": "float",
    "top_p": "float",
    "min_p": "float",
    "repetition_penalty": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "ignore_eos": "bool",
    "include_stop_str_in_output": "bool",
    "skip_special_tokens": "bool",
    "stop": "str or list of str",
    "stop_token_ids": "list of int",
    "prompt_logprobs": "int",
    "logit_bias": "object of token id: number",
}


def _check_type(name: str, v: Any) -> None:
    """Raise ``ValueError`` naming the field when a request's value has the wrong JSON type."""
    want = FIELD_TYPES[name]
    ok = {
        "int": lambda: _is_int(v),
        "float": lambda: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda: isinstance(v, bool),
        "str or list of str": lambda: (
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        ),
        "list of int": lambda: isinstance(v, list) and all(_is_int(x) for x in v),
        "object of token id: number": lambda: (
            isinstance(v, dict)
            and all(
                str(k).isdigit() and isinstance(x, (int, float)) and not isinstance(x, bool)
                for k, x in v.items()
            )
        ),
    }[want]()
    if not ok and not (v is None and name in ("seed", "logprobs", "stop", "prompt_logprobs", "logit_bias")):
        raise ValueError(f"{name} must be {want}, got {v!r}")


def _params(args: argparse.Namespace, r: dict[str, Any], i: int, fallback: dict[str, Any]) -> SamplingParams:
    from llmlab.inference.sampling import SamplingParams

    kw = {
        k: getattr(args, k)
        for k in (
            "max_tokens",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
            "stop",
        )
        if getattr(args, k, None) is not None
    }
    kw["seed"] = args.seed + i
    kw.update({k: r[k] for k in PER_REQUEST if k in r})
    unknown = sorted(set(r) - set(PER_REQUEST) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"unknown request fields {unknown}; known: {', '.join(PER_REQUEST)}")
    for k in PER_REQUEST:
        if k in r:
            _check_type(k, r[k])
    return SamplingParams(**{**fallback, **kw})


def _row(i: int, o: RequestOutput) -> dict[str, Any]:
    c = o.outputs[0]
    row: dict[str, Any] = {
        "index": i,
        "prompt_token_ids": o.prompt_token_ids,
        "token_ids": c.token_ids,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "error": o.error,
        "sampling_defaults": o.sampling_defaults,
    }
    if len(o.outputs) > 1:  # n > 1: every sample; the top-level fields are the first one's
        row["outputs"] = [
            {"token_ids": s.token_ids, "text": s.text, "finish_reason": s.finish_reason} for s in o.outputs
        ]
    if c.logprobs is not None:
        row["logprobs"] = [_lp_list(d) for d in c.logprobs]
    if o.prompt_logprobs is not None:
        row["prompt_logprobs"] = [None if d is None else _lp_list(d) for d in o.prompt_logprobs]
    return row


def _lp_list(d: dict[int, Logprob]) -> list[dict[str, Any]]:
    return [
        {"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "text": lp.decoded_token}
        for t, lp in d.items()
    ]


def _answered(outs: list[RequestOutput | None]) -> list[RequestOutput]:
    """Every request's output (each gets one: its error or its generation)."""
    done = [o for o in outs if o is not None]
    if len(done) != len(outs):
        raise RuntimeError(f"{len(outs) - len(done)} of {len(outs)} requests got no output")
    return done


def run(args: argparse.Namespace) -> int:
    import time

    from llmlab.inference.llm import LLM
    from llmlab.inference.outputs import error_output
    from llmlab.inference import tensor_parallel

    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} must be >= 1")
    if tensor_parallel.join_torchrun(args.tensor_parallel_size) != 0:
        tensor_parallel.run_worker(args.model, args.device)  # a torchrun rank other than 0
        return 0
    reqs = read_requests(args)
    llm = LLM(args.model, config=from_args(args, ENGINE_FLAGS))
    fallback = {k: v for k, v in CLI_DEFAULTS.items() if k not in llm.engine.generation_defaults}
    outs: list[RequestOutput | None] = [None] * len(reqs)
    todo: list[tuple[int, dict[str, Any], SamplingParams]] = []
    for i, r in enumerate(reqs):
        try:
            if isinstance(r, str):
                raise ValueError(r)
            params = _params(args, r, i, fallback)
        except (ValueError, TypeError) as e:
            outs[i] = error_output(str(i), r if isinstance(r, dict) else None, str(e), time.perf_counter())
            continue
        todo.append((i, {k: r[k] for k in ("prompt", "prompt_token_ids") if k in r}, params))
    profiling = bool(llm.engine.config.profile_dir) and bool(todo)
    try:
        if profiling:  # --profile-dir: the whole run as one trace
            llm.start_profile()
        if todo:
            for (i, _, _), o in zip(todo, llm.generate([p for _, p, _ in todo], [sp for _, _, sp in todo])):
                outs[i] = o
    finally:
        if profiling:
            print(f"profiler trace written to {llm.stop_profile()}", file=sys.stderr)
        llm.engine.shutdown()
    done = _answered(outs)
    failed = [i for i, o in enumerate(done) if o.error is not None]
    for i in failed:
        print(f"request {i}: error: {done[i].error}", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            for i, o in enumerate(done):
                f.write(json.dumps(_row(i, o)) + "\n")
        print(
            f"wrote {len(done)} result{'s' * (len(done) != 1)} to {args.output}"
            + (f" ({len(failed)} with errors)" if failed else ""),
            file=sys.stderr,
        )
    else:
        for i, o in enumerate(done):
            c = o.outputs[0]
            if i in failed:
                continue
            if len(done) > 1:
                print(f"--- [{i}] finish_reason={c.finish_reason}")
            if c.text is None:
                print(c.token_ids)
            else:
                print((o.prompt or "") + c.text)
    return 2 if failed else 0
