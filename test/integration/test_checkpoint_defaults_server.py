"""A real server on a checkpoint that ships sampling defaults and a chat end-of-turn token only in its
tokenizer: requests inherit generation_config.json's values, generation stops at the tokenizer's
eos_token, /generate is greedy by default, a request's own chat template is refused unless trusted,
and --chat_template replaces the tokenizer's; bad values of the new flags end the start in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG
from lightllm.utils.free_ports import free_port
from server_process import start_server

TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>"
DEFAULTS = {"temperature": 0.25, "top_k": 5, "repetition_penalty": 1.5, "max_new_tokens": 7, "do_sample": True}


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with sampling defaults, and <|im_end|> as the tokenizer's eos_token only."""
    model = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(DEFAULTS))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    special_map = model / "special_tokens_map.json"
    if special_map.exists():
        special_map.write_text(json.dumps({**json.loads(special_map.read_text()), "eos_token": "<|im_end|>"}))
    (model / "chat.jinja").write_text(TEMPLATE)
    return model


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    handle = start_server(checkpoint, tmp_path_factory.mktemp("logs"),
                          ["--max_total_token_num", "4096", "--chat_template", str(checkpoint / "chat.jinja")])
    yield handle
    handle.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, timeout=120)


def test_requests_inherit_the_checkpoint_sampling_defaults(server):
    prompt = {"prompt": "the quick brown fox", "logprobs": 1, "seed": 11, "ignore_eos": True}
    inherited = _post(server, "/v1/completions", prompt).json()
    assert inherited["usage"]["completion_tokens"] == DEFAULTS["max_new_tokens"]
    explicit = _post(server, "/v1/completions", {**prompt, "max_tokens": 7, "temperature": 0.25, "top_k": 5,
                                                 "repetition_penalty": 1.5}).json()
    plain = _post(server, "/v1/completions", {**prompt, "max_tokens": 7, "temperature": 1.0, "top_k": -1,
                                              "repetition_penalty": 1.0}).json()
    logprobs = [choice["choices"][0]["logprobs"]["token_logprobs"] for choice in (inherited, explicit, plain)]
    assert logprobs[0] == logprobs[1]
    assert logprobs[0] != logprobs[2]
    assert "generation defaults: requests without their own value use temperature=0.25" in server.log()


def test_generation_stops_at_the_tokenizer_eos(server, checkpoint):
    im_end = AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids("<|im_end|>")
    answer = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 5, "logit_bias": {str(im_end): 100}})
    choice = answer.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("stop", None, "")


def test_native_generate_samples_as_the_checkpoint_says(server):
    body = {"inputs": "the lazy dog", "parameters": {"seed": 3, "max_new_tokens": 6, "ignore_eos": True}}
    inherited = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    explicit = httpx.post(f"{server.url}/generate", timeout=120, json={**body, "parameters": {
        **body["parameters"], "do_sample": True, "temperature": 0.25, "top_k": 5, "repetition_penalty": 1.5}}).json()
    assert inherited["generated_text"] == explicit["generated_text"]


def test_the_server_template_renders_and_a_request_template_is_refused(server, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "hi there"}]
    answer = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    expected = tokenizer("<<user>> hi there\n<<assistant>>", add_special_tokens=False)["input_ids"]
    assert answer["usage"]["prompt_tokens"] == len(expected)
    refused = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                     "chat_template": "{{ messages }}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=300)


def test_bad_defaults_and_templates_end_the_start_in_one_line(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    for args, expected in (
        (["--model_dir", str(broken)], "generation_config.json: temperature must be >= 0"),
        (["--model_dir", str(checkpoint), "--generation_config", str(tmp_path / "none_here")],
         "expected 'auto', 'none' or a directory"),
        (["--model_dir", str(checkpoint), "--chat_template", "{% for m in messages %}"], "not a valid Jinja template"),
        (["--model_dir", str(checkpoint), "--chat_template", str(tmp_path / "missing.jinja")], "no such file"),
    ):
        proc = _launch(args)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
        assert proc.returncode == EXIT_INVALID_CONFIG, proc.stderr
        assert len(errors) == 1 and expected in errors[0], errors
        assert "Traceback" not in proc.stderr and "starting: model=" not in proc.stdout + proc.stderr
