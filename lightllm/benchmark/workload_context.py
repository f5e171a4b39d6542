"""Whether every request of a comparison's workloads fits the context its servers would take.

Checked before any server starts: a request whose prompt plus output tokens exceed the servers'
``max_req_total_len`` is answered with HTTP 400 when its prompt leaves no room (a run of the
default 48 prompts of 16384 tokens on a 4096-token model failed every one of them in every
repeat, measured nothing and exited 1 minutes later), and otherwise has its output cut to the
room left, so the run would measure other lengths than it reports.  The servers' limit is
derived as each process derives it (the checkpoint's context capped by a sliding window, or
``--max_req_total_len`` in the flags that reach it); the run takes the smallest, since a request
passes through every process of a PD cluster.  ``bench_serving`` applies the same rule
(:func:`check_workloads_within`) to the context a running server reports.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Sequence

from lightllm.benchmark.context_limit import ContextLimit
from lightllm.benchmark.deployment import flag_value
from lightllm.benchmark.workloads import LONG, SCHEDULE_FROM_SEED, ScheduledRequest, WorkloadConfig, build_workload

# The option names in the flag sources are the fields of the options; a command line names them as
# its flags (compare_strategies: extra_args is --server-args).
ProcessFlags = Mapping[str, Mapping[str, Sequence[str]]]


def scheduled_requests(cfg: WorkloadConfig, seeds: Iterable[int]) -> list[ScheduledRequest]:
    """Every request of the schedules of ``cfg`` with ``seeds``.

    Only the generators that draw their schedule from the seed (:data:`SCHEDULE_FROM_SEED`) are
    built once per seed; the others send the same lengths whatever the seed.
    """
    seeds = list(seeds) if cfg.name in SCHEDULE_FROM_SEED else [cfg.seed]
    return [r for seed in seeds for r in build_workload(dataclasses.replace(cfg, seed=seed))]


def longest_request(cfg: WorkloadConfig, seeds: Iterable[int]) -> ScheduledRequest:
    """The request with the most prompt plus output tokens among the schedules of ``cfg`` with ``seeds``."""
    return max(scheduled_requests(cfg, seeds), key=lambda r: r.prompt_len + r.output_len)


def length_fields(cfg: WorkloadConfig, request: ScheduledRequest) -> tuple[list[str], str]:
    """The :class:`WorkloadConfig` fields that set ``request``'s prompt length, and its output length's field."""
    if request.prefix_group < 0:
        prompt = ["long_len" if request.request_class == LONG else "short_len"]
    elif request.prompt_len == cfg.prefix_tokens:
        prompt = ["prefix_tokens"]  # a chat's first turn
    elif request.prompt_len == cfg.prefix_tokens + cfg.short_len:
        prompt = ["prefix_tokens", "short_len"]  # a few-shot prompt or a chat's second turn
    else:
        prompt = ["prefix_tokens", "short_len", "chat_turns"]  # a later chat turn
    override = cfg.long_output_len if request.request_class == LONG else cfg.short_output_len
    return prompt, "output_len" if override is None else f"{request.request_class}_output_len"


def _max_req_total_len(flags: Mapping[str, Sequence[str]]) -> tuple[Optional[int], str]:
    """A process's ``--max_req_total_len`` and the option that gives it (``None``, "" without one).

    A value the server cannot parse, or not positive, is left to the server's own one-line refusal.
    """
    found: tuple[Optional[int], str] = (None, "")
    for option, args in flags.items():
        text = flag_value(args, "--max_req_total_len")
        if text is not None:
            try:
                value = int(text)
            except ValueError:
                continue
            if value >= 1:
                found = (value, option)
    return found


def servers_context(model_dir: str, processes: ProcessFlags) -> Optional[ContextLimit]:
    """The smallest context among the processes of one launch (``None`` when the checkpoint cannot be read).

    ``processes`` maps each process kind to the flags of every option reaching it
    (:meth:`~lightllm.benchmark.server_launcher.Topology.process_flags`).  A checkpoint whose
    config cannot be read is refused by the servers themselves, in one line, at their start.

    """
    from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError

    try:
        config = ModelConfig.from_dir(model_dir)
    except ModelConfigError:
        return None
    limits: dict[tuple[Optional[int], str], ContextLimit] = {}
    for flags in processes.values():
        value, option = _max_req_total_len(flags)
        if (value, option) not in limits:
            limits[(value, option)] = ContextLimit.of_server(config, model_dir, value, option)
    return min(limits.values(), key=lambda limit: limit.tokens)


def check_workloads_fit(model_dir: str, workloads: Sequence[WorkloadConfig], seeds: Iterable[int],
                        processes: ProcessFlags) -> None:
    """Refuse a workload with a request longer than the servers' context, naming the fields to change.

    ``seeds``: every workload seed the run uses (the warm-up's and each repeat's).

    Raises:
        ValueError: one line naming the workload, the request's lengths and the fields setting them.
    """
    limit = servers_context(model_dir, processes)
    if limit is not None:
        check_workloads_within(limit, workloads, seeds)


def check_workloads_within(limit: ContextLimit, workloads: Sequence[WorkloadConfig], seeds: Iterable[int],
                           servers: str = "the servers") -> None:
    """Refuse a workload with a request longer than ``limit``, naming the fields to change.

    The rule and wording of every tool that sends a workload: :func:`check_workloads_fit` with the
    context it derives for the servers it starts, ``bench_serving`` with the one a running server
    reports.  ``servers`` names who would cut the output ("the server" for a single one).

    Raises:
        ValueError: one line naming the workload, the request's lengths and the fields setting them.
    """
    seeds = list(seeds)
    for cfg in workloads:
        worst = longest_request(cfg, seeds)
        total = worst.prompt_len + worst.output_len
        if total <= limit.tokens:
            continue
        prompt, output = length_fields(cfg, worst)
        remedy = f"lower {', '.join(prompt)} or {output}"
        if limit.source.startswith("--max_req_total_len"):
            remedy += " (or raise that --max_req_total_len)"
        consequence = overflow_consequence(worst.prompt_len, worst.output_len, limit.tokens, servers)
        raise ValueError(f"workload {cfg.name} has a {worst.request_class} request of {worst.prompt_len} prompt "
                         f"tokens ({' + '.join(prompt)}) plus {worst.output_len} output tokens ({output}), "
                         f"{total} in all, more than {limit.name} of {limit.tokens} ({limit.source}); "
                         f"{consequence}: {remedy}")


def overflow_consequence(prompt_len: int, output_len: int, limit: int, servers: str = "the servers") -> str:
    """What the servers' completions endpoint does with a request of these lengths past ``limit``.

    It refuses a prompt that leaves no room and an output longer than the whole context, and cuts
    any other output to the room the prompt leaves (as vLLM does): the run would then finish, but
    measuring other lengths than the workload asks for.  ``servers`` names them in the sentence.
    """
    if prompt_len >= limit or output_len > limit:
        return "every such request would fail with HTTP 400"
    return (f"{servers} would cut such a request's output to {limit - prompt_len} tokens, so the run would not "
            "measure the lengths asked for")
