"""The launcher's first check of a checkpoint: every file the server reads can be opened by this
user (a Hugging Face cache snapshot whose blob is gone, a FIFO, a link loop), and files it never
reads are not checked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from checkpoint_damage_support import copy_checkpoint, launcher_refusal, shard_in_two
from lightllm.server.launch.checkpoint_access import checkpoint_access_problem


def _hf_snapshot(source: Path, tmp_path: Path, missing_blob: str) -> Path:
    """A Hugging Face cache layout: the snapshot's files link to ``../../blobs/<name>``; one blob is gone."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            blob = repo / "blobs" / f"blob-{path.name}"
            shutil.copyfile(path, blob)
            (snapshot / path.name).symlink_to(f"../../blobs/{blob.name}")
    (repo / "blobs" / f"blob-{missing_blob}").unlink()
    return snapshot


def _dangling_weights(source: Path, tmp_path: Path) -> Path:
    return _hf_snapshot(source, tmp_path, "model.safetensors")


def _dangling_tokenizer(source: Path, tmp_path: Path) -> Path:
    return _hf_snapshot(source, tmp_path, "tokenizer.json")


def _dangling_config(source: Path, tmp_path: Path) -> Path:
    return _hf_snapshot(source, tmp_path, "config.json")


@pytest.mark.parametrize("build, name", [(_dangling_weights, "model.safetensors"),
                                         (_dangling_tokenizer, "tokenizer.json"),
                                         (_dangling_config, "config.json")])
def test_a_dangling_link_is_refused_in_one_line_naming_it_and_its_target(tiny_llama_dir, tmp_path, build, name):
    model_dir = build(tiny_llama_dir, tmp_path)
    line = launcher_refusal(model_dir, "--device", "cpu")
    assert f"{model_dir}/{name} is a dangling link to ../../blobs/blob-{name} (" in line
    assert f"models--org--tiny/blobs/blob-{name} does not exist)" in line


def test_what_cannot_be_opened_is_named(tiny_llama_dir, tmp_path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "fifo")
    (model_dir / "tokenizer.json").unlink()
    os.mkfifo(model_dir / "tokenizer.json")
    assert checkpoint_access_problem(model_dir) == f"{model_dir}/tokenizer.json is not a regular file"
    assert checkpoint_access_problem(tiny_llama_dir) is None
    # A PD master reads no weights: a missing blob there is not its concern.
    weights_gone = _dangling_weights(tiny_llama_dir, tmp_path)
    assert checkpoint_access_problem(weights_gone, weights=False) is None
    assert "model.safetensors is a dangling link" in checkpoint_access_problem(weights_gone)


def test_files_the_server_never_reads_are_not_checked(tiny_llama_dir, tmp_path) -> None:
    # A checkpoint's LICENSE.txt, a training run's trainer_state.json or Mistral's params.json are
    # never opened: a broken one must not refuse the start.
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "extras")
    for name in ("LICENSE.txt", "trainer_state.json", "params.json"):
        (model_dir / name).symlink_to(f"/nonexistent/{name}")
    assert checkpoint_access_problem(model_dir) is None
    # A link loop where the server reads is named as what it is.
    (model_dir / "merges.txt").symlink_to("merges.txt")
    assert checkpoint_access_problem(model_dir) == (f"{model_dir}/merges.txt cannot be read "
                                                    "(Too many levels of symbolic links)")


def test_with_an_index_only_the_shards_it_names_are_checked(tiny_llama_dir, tmp_path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "sharded")
    shard_in_two(model_dir)
    (model_dir / "consolidated.safetensors").symlink_to("/nonexistent/consolidated.safetensors")
    assert checkpoint_access_problem(model_dir) is None
    shard = sorted(set(json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    (model_dir / shard).unlink()
    (model_dir / shard).symlink_to("/nonexistent/shard")
    assert f"{model_dir}/{shard} is a dangling link to /nonexistent/shard" in checkpoint_access_problem(model_dir)


def test_the_weights_are_checked_by_the_loader_s_rule(tiny_llama_dir, tmp_path) -> None:
    # Without an index the loader reads model.safetensors alone: a consolidated copy beside it is
    # never opened (Mistral repositories carry one), so a broken one must not refuse the start.
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "consolidated")
    (model_dir / "consolidated.safetensors").symlink_to("/nonexistent/consolidated.safetensors")
    assert checkpoint_access_problem(model_dir) is None


def test_tokenizer_files_found_by_name_pattern_or_config_are_checked(tiny_llama_dir, tmp_path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "named")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["fast_tokenizer_files"] = ["tokenizer-fast.json"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "tokenizer-fast.json").symlink_to("/nonexistent/fast")
    assert "tokenizer-fast.json is a dangling link" in checkpoint_access_problem(model_dir)
    (model_dir / "tokenizer-fast.json").unlink()
    (model_dir / "tokenizer.model.v3").symlink_to("/nonexistent/v3")
    assert "tokenizer.model.v3 is a dangling link" in checkpoint_access_problem(model_dir)


def test_additional_chat_templates_are_checked_when_transformers_would_open_them(tiny_llama_dir, tmp_path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "templates")
    templates = model_dir / "additional_chat_templates"
    templates.mkdir()
    (templates / "gone.jinja").symlink_to("/nonexistent/gone.jinja")  # transformers skips it
    assert checkpoint_access_problem(model_dir) is None
    (templates / "tool_use.jinja").unlink(missing_ok=True)
    os.mkfifo(templates / "tool_use.jinja")
    assert checkpoint_access_problem(model_dir) == f"{templates}/tool_use.jinja is not a regular file"

