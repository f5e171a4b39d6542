"""A weight file the ranks could not open, or an index sending a tensor to a shard that does not hold
it, is refused from the safetensors headers alone, in one line naming the file, exactly where
safetensors itself would refuse; the ranks' loader names the file should safetensors still fail."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from checkpoint_damage_support import copy_checkpoint, misassign_first_tensor, shard_in_two, truncate
from lightllm.common.basemodel.checkpoint_files import CheckpointFilesError
from lightllm.common.basemodel.safetensors_header import read_safetensors_header
from lightllm.common.basemodel.weight_headers import read_weight_headers
from lightllm.common.basemodel.weight_loader import CheckpointError, SafetensorsCheckpoint


def _write_raw(path: Path, header: object, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _valid(path: Path) -> Path:
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})
    return path


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _damage(kind: str) -> Callable[[Path], str]:
    """A function damaging a valid file the way ``kind`` says; returns what the refusal must say."""

    def damage(path: Path) -> str:
        header, data = _header_and_data(path)
        if kind == "truncated":
            truncate(path, 3)
            return "is truncated: its safetensors header places tensor data up to byte 52, but the file holds 49 " \
                   "bytes of data (3 bytes missing)"
        if kind == "empty":
            path.write_bytes(b"")
            return "is not a safetensors file: 0 bytes, shorter than the 8-byte header length"
        if kind == "short":
            path.write_bytes(b"\x01\x02\x03")
            return "is not a safetensors file: 3 bytes"
        if kind == "trailing":
            path.write_bytes(path.read_bytes() + b"xx")
            return "has 2 bytes past the end of its tensors' data"
        if kind == "header_past_end":
            path.write_bytes(path.read_bytes()[:20])
            return "-byte header, but the file is 20 bytes"
        if kind == "not_json":
            path.write_bytes(struct.pack("<Q", 4) + b"abcd")
            return "its safetensors header is not valid JSON"
        if kind == "json_list":
            path.write_bytes(struct.pack("<Q", 2) + b"[]")
            return "its safetensors header is a JSON list, not an object of tensors"
        if kind == "wrong_size":
            header["a"]["data_offsets"] = [0, 44]
            header["b"]["data_offsets"] = [44, 48]
            _write_raw(path, header, data[:48])
            return "tensor 'a' is F32 of shape [3, 4] in its safetensors header, which does not fit the 44 bytes"
        if kind == "gap":
            header["b"]["data_offsets"] = [50, 54]
            _write_raw(path, header, data + b"xx")
            return "tensor 'b' has data_offsets [50, 54] in its safetensors header, but the previous tensor's data " \
                   "ends at 48"
        if kind == "header_too_large":
            path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
            return "give a 100000001-byte header, more than the 100000000 bytes safetensors reads"
        if kind == "metadata_not_strings":
            _write_raw(path, {**header, "__metadata__": {"format": 1}}, data)
            return "its safetensors header's __metadata__ is {'format': 1}, not an object of strings"
        if kind == "no_offsets":
            del header["a"]["data_offsets"]
            _write_raw(path, header, data)
            return "describes tensor 'a' as"
        raise AssertionError(kind)

    return damage


DAMAGE = ["truncated", "empty", "short", "trailing", "header_past_end", "header_too_large", "not_json", "json_list",
          "wrong_size", "gap", "metadata_not_strings", "no_offsets"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_file_safetensors_cannot_open_is_refused_naming_it(tmp_path: Path, kind: str) -> None:
    path = _valid(tmp_path / "model.safetensors")
    message = _damage(kind)(path)
    # The check mirrors the reader the ranks use: it refuses only what that reader refuses.
    with pytest.raises(SafetensorError):
        safe_open(str(path), framework="pt")
    with pytest.raises(CheckpointFilesError) as refused:
        read_safetensors_header(path)
    text = str(refused.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text, text


def test_a_valid_file_passes_with_its_tensors_and_metadata_aside(tmp_path: Path) -> None:
    path = _valid(tmp_path / "model.safetensors")
    header = read_safetensors_header(path)
    assert sorted(header.tensors) == ["a", "b"]
    assert (header.tensors["a"].dtype, header.tensors["a"].shape, header.tensors["b"].end) == ("F32", (3, 4), 52)
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(header.tensors)
    header, data = _header_and_data(path)
    _write_raw(path, {**header, "__metadata__": None}, data)
    assert sorted(read_safetensors_header(path).tensors) == ["a", "b"]
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    assert read_safetensors_header(empty).tensors == {}


def test_an_unknown_dtype_is_left_to_the_reader(tmp_path: Path) -> None:
    # A dtype a later safetensors may add: its size is not judged here (the layout still is).
    path = _valid(tmp_path / "model.safetensors")
    header, data = _header_and_data(path)
    header["b"]["dtype"] = "F8_FUTURE"
    _write_raw(path, header, data)
    assert read_safetensors_header(path).tensors["b"].dtype == "F8_FUTURE"


def test_the_headers_of_a_sharded_checkpoint_are_read_per_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "sharded")
    names = shard_in_two(model_dir)
    headers = read_weight_headers(model_dir)
    assert [path.name for path in headers] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(name for header in headers.values() for name in header.tensors) == names


def test_a_truncated_shard_is_refused_naming_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "truncated")
    shard_in_two(model_dir)
    truncate(model_dir / "model-00002-of-00002.safetensors", 1000)
    match = r"model-00002-of-00002\.safetensors is truncated: .* \(1000 bytes missing\); download or copy the file again$"
    with pytest.raises(CheckpointFilesError, match=match):
        read_weight_headers(model_dir)
    # The ranks' loader applies the same checks when it opens the checkpoint.
    with pytest.raises(CheckpointFilesError, match=match):
        SafetensorsCheckpoint(model_dir)


def test_an_index_assigning_a_tensor_to_the_wrong_shard_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "wrong_shard")
    shard_in_two(model_dir)
    name = misassign_first_tensor(model_dir)
    expected = (f"model.safetensors.index.json assigns tensor {name!r} to model-00002-of-00002.safetensors, which "
                f"does not hold it (model-00001-of-00002.safetensors does): the index does not match the shards")
    for read in (read_weight_headers, SafetensorsCheckpoint):
        with pytest.raises(CheckpointFilesError) as refused:
            read(model_dir)
        assert str(refused.value).endswith(expected), str(refused.value)


def test_an_index_naming_a_tensor_no_shard_holds_says_so_and_counts_the_rest(tiny_llama_dir: Path,
                                                                              tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "ghosts")
    shard_in_two(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({"ghost.a": "model-00001-of-00002.safetensors",
                                "ghost.b": "model-00002-of-00002.safetensors"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFilesError, match=r"assigns tensor 'ghost\.a' to model-00001-of-00002\.safetensors, "
                                                   r"which does not hold it \(no weight file does\) \(1 more tensor"):
        read_weight_headers(model_dir)


def test_the_loader_names_the_file_when_safetensors_fails_after_the_checks(tiny_llama_dir: Path,
                                                                          tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "damaged_later")
    checkpoint = SafetensorsCheckpoint(model_dir)  # the checks pass; then the file is damaged
    truncate(model_dir / "model.safetensors", 1000)
    name = sorted(checkpoint.unread())[0]
    with pytest.raises(CheckpointError) as failed:
        checkpoint.get(name, torch.float32)
    text = str(failed.value)
    assert text.startswith(f"checkpoint file {model_dir / 'model.safetensors'}: ") and "\n" not in text, text
