"""kv_transfer.bench: an oversized --tokens, a page above --tokens, Ctrl-C and --help (outside tester's
report on the tools, items 6, 7, 12 and 14)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightllm.server.pd.kv_transfer import bench

_LLAMA = {"model_type": "llama", "vocab_size": 4, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, "torch_dtype": "float32"}


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA))
    return str(tmp_path)


def test_tokens_the_caches_cannot_hold_are_refused_before_allocating(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *_a: pytest.fail("it allocated"))
    monkeypatch.setattr(bench, "available_memory_bytes", lambda: 2**30)
    with pytest.raises(SystemExit) as refused:
        bench.main(["--model_dir", model_dir, "--tokens", "99999999999", "--page_sizes", "64", "--repeat", "1"])
    err = capsys.readouterr().err.splitlines()
    assert refused.value.code == 2 and len(err) == 1, err
    # 1 layer x 1 KV head x 4 dims x (K, V) x 4 bytes = 32 bytes a slot; 2 caches x 2 x tokens slots.
    assert err[0].startswith("error: --tokens 99999999999 needs about "), err
    assert "GiB at its peak (the two caches" in err[0] and "this machine has 1.0 GiB available" in err[0]


def test_the_peak_counts_more_than_the_caches(model_dir):
    # An outside review measured about twice the caches with a page as large as the transfer (the
    # receiver's and sender's page buffers) and ~1.2x with small pages (a copy while sharing).
    geometry = bench._geometry(Path(model_dir))
    caches = bench.cache_bytes(131072, geometry)
    whole_page, small_pages = bench.peak_bytes(131072, [131072], geometry), bench.peak_bytes(131072, [64], geometry)
    assert whole_page >= 2 * caches and caches * 1.2 <= small_pages < whole_page
    # The largest page size decides.
    assert bench.peak_bytes(131072, [64, 131072], geometry) == whole_page


def test_a_shared_memory_too_small_for_the_caches_is_refused(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *_a: pytest.fail("it allocated"))
    monkeypatch.setattr(bench, "available_memory_bytes", lambda: 2**40)
    monkeypatch.setattr(bench, "shared_memory_free_bytes", lambda: 64 << 20)
    with pytest.raises(SystemExit) as refused:
        bench.main(["--model_dir", model_dir, "--tokens", "1048576", "--page_sizes", "64", "--repeat", "1"])
    err = capsys.readouterr().err.splitlines()
    assert refused.value.code == 2 and len(err) == 1, err
    assert "of shared memory for the two caches; /dev/shm has 0.1 GiB free" in err[0], err


def test_the_cache_size_is_what_measure_allocates(model_dir):
    geometry = bench._geometry(Path(model_dir))
    assert bench.cache_bytes(256, geometry) == 2 * 2 * 256 * 32


def test_a_page_above_tokens_is_said(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *_a: [])
    assert bench.main(["--model_dir", model_dir, "--tokens", "256", "--page_sizes", "64", "1000"]) == 0
    out = capsys.readouterr().out
    assert "note: page size 1000 is above --tokens 256: each transfer is one partial page" in out


def test_ctrl_c_is_one_line_and_exit_130(model_dir, capsys, monkeypatch):
    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "measure", interrupted)
    assert bench.main(["--model_dir", model_dir, "--tokens", "256"]) == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: interrupted; every transfer process it started was stopped")


def test_help_states_the_defaults(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = {action.dest: action.default for action in bench.build_parser()._actions}
    assert f"(default {defaults['tokens']})" in text and f"(default {defaults['repeat']})" in text
    assert f"(default {defaults['data_type']})" in text
