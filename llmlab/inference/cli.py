"""``llmlab generate``: offline generation with the paged-KV-cache engine (see CONTRACT.md).

    llmlab generate --prompt "ROMEO:"                         # the shipped shakespeare model
    llmlab generate --model DIR --prompts-file in.jsonl --temperature 0 --output out.jsonl

``in.jsonl``: one request per line, ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``, with
optional ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``.
``out.jsonl``: one line per request in input order: ``index``, ``prompt_token_ids``,
``token_ids``, ``text`` (null without a tokenizer) and ``finish_reason`` (``length``/``stop``).
"""
from __future__ import annotations

import argparse
import json
import sys

PER_REQUEST = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="shakespeare",
                   help="checkpoint directory (HF Llama/Qwen2 or llmlab) or a preset with shipped "
                        "weights (default: shakespeare, bundled)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT", help="prompt text(s)")
    src.add_argument("--prompts-file", metavar="IN.jsonl", help="one JSON request per line")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per request (default 128)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="default 0.8; 0 = greedy (the tokens Hugging Face generate(do_sample=False) gives)")
    p.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (request i uses seed + i)")
    p.add_argument("--stop", nargs="+", action="extend", default=None, metavar="S",
                   help="stop strings")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV-cache blocks (default: sized "
                   "for max-num-seqs full-length sequences, at most 64 MiB on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--enable-chunked-prefill", action="store_true")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--output", metavar="OUT.jsonl", default=None, help="write results as JSONL")


def read_requests(args) -> list[dict]:
    if args.prompt:
        return [{"prompt": t} for t in args.prompt]
    reqs = []
    with open(args.prompts_file) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts_file}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(r, dict) or not ("prompt" in r or "prompt_token_ids" in r):
                raise ValueError(f"{args.prompts_file}:{n}: needs 'prompt' or 'prompt_token_ids'")
            reqs.append(r)
    if not reqs:
        raise ValueError(f"{args.prompts_file} holds no requests")
    return reqs


def run(args: argparse.Namespace) -> int:
    from llmlab.inference.llm import LLM
    from llmlab.inference.sampling import SamplingParams
    reqs = read_requests(args)
    params = []
    for i, r in enumerate(reqs):
        kw = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "seed": args.seed + i, "stop": args.stop}
        kw.update({k: r[k] for k in PER_REQUEST if k in r})
        params.append(SamplingParams(**kw))
    llm = LLM(args.model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching,
              enable_chunked_prefill=args.enable_chunked_prefill, device=args.device)
    prompts = [{k: r[k] for k in ("prompt", "prompt_token_ids") if k in r} for r in reqs]
    outs = llm.generate(prompts, params)
    if args.output:
        with open(args.output, "w") as f:
            for i, o in enumerate(outs):
                c = o.outputs[0]
                f.write(json.dumps({"index": i, "prompt_token_ids": o.prompt_token_ids,
                                    "token_ids": c.token_ids, "text": c.text,
                                    "finish_reason": c.finish_reason}) + "\n")
        print(f"wrote {len(outs)} result{'s' * (len(outs) != 1)} to {args.output}", file=sys.stderr)
    else:
        for i, o in enumerate(outs):
            c = o.outputs[0]
            if len(outs) > 1:
                print(f"--- [{i}] finish_reason={c.finish_reason}")
            if c.text is None:
                print(c.token_ids)
            else:
                print((o.prompt or "") + c.text)
    return 0
