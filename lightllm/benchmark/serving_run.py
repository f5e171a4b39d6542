"""The serving benchmark's reusable core: its configuration, the prompts of a workload, and
:func:`run_benchmark`, which sends them to a server and summarizes the answers.

:mod:`lightllm.benchmark.bench_serving` is its command line; the strategy comparison and the
prefix-affinity benchmark drive it directly.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence


from lightllm.benchmark.backends import BACKENDS, MULTI_GENERATION_FIELDS, RequestInput
from lightllm.benchmark.metrics import (COUNT_FROM_STREAM, COUNT_FROM_TOKENIZER, RequestRecord, parse_slo, summarize,
                                        write_records_jsonl)
from lightllm.benchmark.open_loop_sender import make_client, send_all
from lightllm.benchmark.prompts import PromptBuilder
from lightllm.benchmark.server_probe import fetch_default_model
from lightllm.benchmark.workloads import ScheduledRequest, WorkloadConfig, build_workload

PROMPT_FORMATS: tuple[str, ...] = ("text", "ids")


@dataclasses.dataclass
class BenchmarkConfig:
    """One benchmark run against one server.

    ``workload.seed`` seeds both the schedule and the prompt contents; ``prompt_namespace``
    gives warm-up rounds prompts of their own so they do not warm the prefix cache for
    the measured round. ``max_concurrency`` of ``None`` means unbounded. ``api_key`` is sent
    as ``Authorization: Bearer`` with every request (none when ``None``); the summary does not
    record it.
    """

    base_url: str = "http://127.0.0.1:8000"
    backend: str = "openai-completions"
    model: str | None = None
    tokenizer: str | None = None
    workload: WorkloadConfig = dataclasses.field(default_factory=WorkloadConfig)
    prompt_format: str = "text"
    shared_prefix_len: int = 0
    max_concurrency: int | None = None
    slo: dict[str, float] = dataclasses.field(default_factory=dict)
    ignore_eos: bool = True
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)
    request_timeout_s: float = 3600.0
    prompt_namespace: str = "measure"
    output_jsonl: str | None = None
    show_progress: bool = True
    api_key: str | None = dataclasses.field(default=None, repr=False)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if self.prompt_format == "ids" and not BACKENDS[self.backend].accepts_token_ids:
            raise ValueError(f"prompt_format 'ids' is not supported by backend {self.backend!r}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be >= 1 (or None: no limit), got {self.max_concurrency}")
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        # Merged last into every body, such a key would silently replace what the run asks for
        # and reports (a max_tokens of 1 measured one-token outputs as the workload's lengths).
        controlled = [key for key in self.extra_body if key in BACKENDS[self.backend].controlled_fields]
        if controlled:
            raise ValueError(f"extra_body must not set {', '.join(controlled)}: the benchmark sets "
                             f"{'it' if len(controlled) == 1 else 'them'} itself for backend {self.backend} (the "
                             "output length from the workload, the model from --model, ignore_eos from "
                             "--no-ignore-eos, the prompt from the workload, streaming to time every token)")
        several = [key for key in self.extra_body if key in MULTI_GENERATION_FIELDS]
        if several:
            raise ValueError(f"extra_body must not set {', '.join(several)}: the benchmark measures one generation "
                             "per request, and several would stream interleaved as one (their tokens counted as "
                             "one request's, TPOT and ITL mixing them)")
        parse_slo(f"{k}:{v}" for k, v in self.slo.items())


def check_tokenizer_dir(path: str | None) -> None:
    """Raise ValueError unless ``path`` is an existing directory (cheap: nothing is loaded)."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"tokenizer must be a local tokenizer directory, got {path!r}")


def load_tokenizer(path: str | None) -> Any:
    """Load the served model's tokenizer from a local Hugging Face directory."""
    check_tokenizer_dir(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prepare_requests(
    schedule: Sequence[ScheduledRequest],
    builder: PromptBuilder,
    *,
    prompt_format: str = "text",
    seed: int = 0,
    namespace: str = "measure",
    shared_prefix_len: int = 0,
) -> list[RequestInput]:
    """Attach an exact-length prompt to every scheduled request."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    requests = []
    for index, item in enumerate(schedule):
        prompt = builder.build(
            index,
            item.prompt_len,
            seed=seed,
            namespace=namespace,
            shared_prefix_len=shared_prefix_len,
            prefix_group=item.prefix_group,
            prefix_len=item.prefix_len,
        )
        requests.append(
            RequestInput(
                index=index,
                request_class=item.request_class,
                prompt=prompt.text if prompt_format == "text" else prompt.token_ids,
                prompt_tokens=prompt.num_tokens,
                output_len=item.output_len,
                scheduled_time=item.scheduled_time_s,
            )
        )
    return requests


def count_unreported_output(records: Sequence[RequestRecord], builder: PromptBuilder) -> None:
    """Count with the tokenizer the output of every response whose server reported no token count.

    Such a record counted the chunks it received, and a server may pack several tokens into one
    (halving the count); its generated text, counted as vLLM's benchmark counts it (no special
    tokens added), is the better estimate.  The record says so (``output_tokens_source``
    ``"tokenizer"``), and the text is dropped.  Done after the run, so tokenizing never delays
    the timing of a request still in flight.
    """
    for record in records:
        if record.generated_text is not None and record.output_tokens_source == COUNT_FROM_STREAM:
            record.output_tokens = builder.count_tokens(record.generated_text)
            record.output_tokens_source = COUNT_FROM_TOKENIZER
        record.generated_text = None


async def run_benchmark(config: BenchmarkConfig, builder: PromptBuilder | None = None, *,
                        finished: list[RequestRecord] | None = None, write_records: bool = True) -> dict[str, Any]:
    """Run one benchmark and return its JSON-serialisable summary.

    ``builder`` may be passed to reuse a tokenizer scan across runs; otherwise the
    tokenizer is loaded from ``config.tokenizer``. Raw records go to
    ``config.output_jsonl`` when set, unless ``write_records`` is False (the caller writes them).
    ``finished`` gets each request's record as the request ends, so a caller that is
    interrupted still has the records of the requests that finished.
    """
    config.validate()
    if builder is None:
        builder = PromptBuilder(load_tokenizer(config.tokenizer))
    schedule = build_workload(config.workload)
    requests = prepare_requests(
        schedule,
        builder,
        prompt_format=config.prompt_format,
        seed=config.workload.seed,
        namespace=config.prompt_namespace,
        shared_prefix_len=config.shared_prefix_len,
    )
    async with make_client(config.request_timeout_s, config.api_key) as client:
        model = config.model
        if model is None and BACKENDS[config.backend].needs_model:
            model = await fetch_default_model(client, config.base_url)
        records = await send_all(
            client,
            config.base_url,
            config.backend,
            model,
            requests,
            ignore_eos=config.ignore_eos,
            extra_body=config.extra_body,
            max_concurrency=config.max_concurrency,
            show_progress=config.show_progress,
            finished=finished,
        )
    count_unreported_output(records, builder)
    if config.output_jsonl and write_records:
        write_records_jsonl(config.output_jsonl, records)
    summary = summarize(records, config.slo)
    summary["model"] = model
    summary["config"] = dataclasses.asdict(config)
    # A secret has no place in a results file; whether one was sent is what a reader needs.
    summary["config"]["api_key"] = "<given>" if config.api_key else None
    return summary
