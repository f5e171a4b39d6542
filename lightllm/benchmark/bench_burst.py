"""Throughput of a burst of non-streaming requests, all sent at once.

``python -m lightllm.benchmark.bench_burst --base-url http://127.0.0.1:8000 --num-requests 128
--prompt-len 128 --output-len 64 --rounds 3`` sends ``num-requests`` ``/v1/completions`` calls
concurrently (token-id prompts of exact length, ``ignore_eos``) and reports output tokens/s per
round.  Without streaming the client costs almost nothing per token, so on a small machine this
isolates the engine from the per-token cost of SSE on both ends; ``bench_serving`` measures the
streaming case with full latency metrics.  Every request, and the ``/v1/models`` probe before the
first burst, carries ``--api-key`` (default ``OPENAI_API_KEY``) as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Dict, List, Optional

import httpx

from lightllm.benchmark.cli_args import OneLineErrorParser, http_url, non_negative_int, output_file
from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.output_writing import write_outputs_or_exit
from lightllm.benchmark.server_probe import NO_LISTING_STATUSES, ServerRefused, refused_probe
from lightllm.utils.http_client_support import API_KEY_HELP, auth_headers, default_api_key, http_refusal


async def run_round(base_url: str, model: str, prompts: List[List[int]], output_len: int,
                    api_key: Optional[str] = None) -> Dict[str, float]:
    """One burst; returns completion tokens, seconds and tokens/s.

    Raises:
        ServerRefused: a request was answered with an HTTP error (the server's message in one line).
        httpx.HTTPError: a request got no answer.
    """
    # httpx keeps at most 100 connections by default: a larger burst would go out 100 at a time.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, trust_env=False, limits=limits, headers=auth_headers(api_key)) as client:

        async def one(prompt: List[int]) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0}
            resp = await client.post(f"{base_url}/v1/completions", json=body)
            if resp.status_code >= 400:
                raise ServerRefused(http_refusal(resp))
            return int(resp.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        seconds = time.perf_counter() - started
    return {"completion_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def make_prompts(num: int, length: int, vocab: int, seed: int, round_index: int) -> List[List[int]]:
    """Random token-id prompts; each round gets fresh ones so the prefix cache cannot help."""
    rng = random.Random(seed * 1_000_003 + round_index)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(num)]


@interruptible("the rounds that finished were printed; --output-json, if given, was not written (or not whole)")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_burst", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", type=http_url, default="http://127.0.0.1:8000",
                        help="server to send the bursts to (default http://127.0.0.1:8000)")
    parser.add_argument("--model", default=None, help="default: the first id from /v1/models")
    parser.add_argument("--api-key", default=default_api_key(), help=API_KEY_HELP)
    parser.add_argument("--num-requests", type=int, default=128,
                        help="requests of one burst, all sent at once (default 128)")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="token ids of every prompt, drawn at random (default 128)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="completion tokens of every request; EOS is ignored (default 64)")
    parser.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [5, vocab) (default 1000)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="bursts sent one after another, each with fresh prompts (default 3)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompts' token ids, >= 0 (default 0)")
    parser.add_argument("--output-json", type=output_file, default=None, help="also write the rounds here (JSON)")
    args = parser.parse_args(argv)
    # Each bad flag is named alone: one message for all four left the reader to find which.
    for flag, value in (("--num-requests", args.num_requests), ("--prompt-len", args.prompt_len),
                        ("--output-len", args.output_len), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.vocab <= 5:
        parser.error(f"--vocab must be > 5 (prompt ids are drawn from [5, vocab)), got {args.vocab}")
    base_url = args.base_url.rstrip("/")
    try:
        # Reached before the first burst also with --model: a burst to no server ended in a traceback.
        answer = httpx.get(f"{base_url}/v1/models", timeout=30, trust_env=False, headers=auth_headers(args.api_key))
        # Also with --model: a server that refuses the probe (401 without its key) refuses every burst;
        # one without /v1/models (404) may still serve the model named.
        if answer.status_code >= 400 and not (args.model and answer.status_code in NO_LISTING_STATUSES):
            raise refused_probe(base_url, "/v1/models", answer)
        model = args.model or answer.json()["data"][0]["id"]
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        print(f"error: cannot reach the server at {base_url} (--base-url): {exc}", file=sys.stderr)
        return 1
    except ServerRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, KeyError, IndexError, TypeError):
        print(f"error: {base_url}/v1/models lists no model; pass --model", file=sys.stderr)
        return 1
    rounds = []
    for index in range(args.rounds):
        prompts = make_prompts(args.num_requests, args.prompt_len, args.vocab, args.seed, index)
        try:
            result = asyncio.run(run_round(base_url, model, prompts, args.output_len, args.api_key))
        except (httpx.HTTPError, ServerRefused) as exc:
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            print(f"error: round {index} failed against {base_url}: {why}", file=sys.stderr)
            return 1
        rounds.append(result)
        print(f"round {index}: {result['completion_tokens']} tokens in {result['seconds']:.2f} s = {result['output_tokens_per_s']:.0f} tok/s")
    # A secret has no place in a results file; whether one was sent is what a reader needs.
    recorded = {**vars(args), "api_key": "<given>" if args.api_key else None}
    # The rounds are printed already; a file that cannot be written is one line naming the flag and path.
    write_outputs_or_exit(parser, [("--output-json", args.output_json,
                                    json.dumps({"args": recorded, "rounds": rounds}, indent=2))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
