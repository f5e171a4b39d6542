"""Baseline without continuous batching: transformers ``generate`` serving requests one at a time.

``python -m lightllm.benchmark.bench_hf_baseline --model_dir DIR --num-requests 128
--prompt-len 128 --output-len 64`` treats every request as sent at time 0 (the same burst the
server benchmark sends) and serves them in order, one ``generate`` call each.  Per-token times
come from a streamer, so TTFT includes the wait behind earlier requests, exactly as a client of
a one-at-a-time server would see it.  Metrics use the same code as the serving benchmark.
"""

from __future__ import annotations

import os
import json
import sys
import time
from typing import List, Optional

import torch

from lightllm.benchmark.cli_args import OneLineErrorParser, non_negative_int, output_file, sequence_too_long
from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.metrics import RequestRecord, format_summary, summarize
from lightllm.benchmark.output_writing import write_outputs_or_exit


class _TokenTimes:
    """A transformers streamer that only records when each new token arrives."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run(model_dir: str, num_requests: int, prompt_len: int, output_len: int, seed: int) -> List[RequestRecord]:
    """Serve the burst sequentially; returns one record per request."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab, (prompt_len,), generator=gen) for _ in range(num_requests)]
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():  # warm-up outside the measured burst
        model.generate(prompts[0][None], generation_config=config)
    records: List[RequestRecord] = []
    burst_start = time.perf_counter()
    with torch.inference_mode():
        for index, prompt in enumerate(prompts):
            streamer = _TokenTimes()
            model.generate(prompt[None], attention_mask=torch.ones(1, prompt_len, dtype=torch.long), generation_config=config, streamer=streamer)
            records.append(
                RequestRecord(
                    index=index,
                    request_class="short",
                    prompt_tokens=prompt_len,
                    scheduled_time=0.0,
                    send_time=0.0,
                    first_token_time=streamer.times[0] - burst_start,
                    token_times=[t - burst_start for t in streamer.times],
                    end_time=streamer.times[-1] - burst_start,
                    output_tokens=len(streamer.times),
                    requested_output_tokens=output_len,
                )
            )
    return records


@interruptible("nothing was written")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point."""
    parser = OneLineErrorParser(prog="python -m lightllm.benchmark.bench_hf_baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="local checkpoint directory transformers loads (fp32)")
    parser.add_argument("--num-requests", type=int, default=128,
                        help="requests of the burst, all sent at time 0 and served one at a time (default 128)")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="tokens of every prompt (random ids); with --output-len within the model's context "
                        "(default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request, greedy (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompts' token ids, >= 0 (default 0)")
    parser.add_argument("--output-json", type=output_file, default=None, help="also write the summary here (JSON)")
    args = parser.parse_args(argv)
    if min(args.num_requests, args.prompt_len, args.output_len, args.threads) < 1:
        parser.error("--num-requests, --prompt-len, --output-len and --threads must be >= 1")
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        parser.error(f"--model_dir must be a local checkpoint directory with a config.json, got {args.model_dir!r}")
    # transformers attends through a sliding window itself: only the positions bound the sequence.
    too_long = sequence_too_long(args.model_dir, {"--prompt-len": args.prompt_len, "--output-len": args.output_len},
                                 exact_attention=False)
    if too_long:
        parser.error(too_long)
    torch.set_num_threads(args.threads)
    summary = summarize(run(args.model_dir, args.num_requests, args.prompt_len, args.output_len, args.seed))
    print(format_summary(summary))
    write_outputs_or_exit(parser, [("--output-json", args.output_json, json.dumps(summary, indent=2))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
