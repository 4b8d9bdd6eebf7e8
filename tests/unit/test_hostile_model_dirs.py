"""Model directories from someone else (models/safetensors_headers.py, description.py):
each broken or hostile one gets one ModelDirError line naming the file and the fix, fast,
without reading more than the header."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from pivot_hpc.errors import PivotError
from pivot_hpc.gps import ModelSpec
from pivot_hpc.models.description import describe
from pivot_hpc.models.safetensors_headers import MAX_HEADER_BYTES, ModelDirError

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 16, "vocab_size": 4, "max_position_embeddings": 32,
}  # fmt: skip
GOOD = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}


def model_dir(tmp_path: Path, header: dict | bytes = GOOD, data: bytes = bytes(128),
              config: dict | str = CONFIG, name: str = "model.safetensors") -> Path:  # fmt: skip
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (d / name).write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return d


def refused(d: Path, *words: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(ModelDirError) as info:
        describe(d)
    assert time.monotonic() - t0 < 1.0
    assert isinstance(info.value, PivotError)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 1000, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_a_good_minimal_directory_is_described(tmp_path):
    d = describe(model_dir(tmp_path))
    assert d.names == ["model.embed_tokens.weight"] and d.tie_word_embeddings  # no lm_head


def test_not_a_model_directory(tmp_path):
    refused(tmp_path / "absent", "not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no config.json")
    d = model_dir(tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 pickles are never read")
    refused(d, "no *.safetensors", "pickled")


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ("{not json", ["config.json", "not valid JSON"]),
        ("[" * 100_000 + "]" * 100_000, ["config.json", "not valid JSON"]),
        ("[1, 2]", ["not a JSON object"]),
        ({**CONFIG, "hidden_size": None}, ["no hidden_size"]),
        ({"text_config": {"vocab_size": 4}}, ["no hidden_size (nor in its text_config)"]),
        ({**CONFIG, "hidden_size": "8"}, ["hidden_size = '8' must be an integer >= 1"]),
        ({**CONFIG, "num_key_value_heads": 3}, ["not a multiple of num_key_value_heads=3"]),
        ({**CONFIG, "eos_token_id": "</s>"}, ["eos_token_id '</s>' must be token ids"]),
    ],
)
def test_bad_configs(tmp_path, config, words):
    refused(model_dir(tmp_path, config=config), *words)


def test_oversized_config_is_not_read(tmp_path):
    d = model_dir(tmp_path)
    with open(d / "config.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: a GiB that is never read
    refused(d, "config.json", "over the 16 MiB")


def header_case(tmp_path: Path, head: bytes) -> Path:
    d = model_dir(tmp_path)
    (d / "model.safetensors").write_bytes(head)
    return d


def test_truncated_and_oversized_headers(tmp_path):
    refused(header_case(tmp_path, b"\x01\x02"), "model.safetensors", "shorter than the 8-byte")
    big = (2**63).to_bytes(8, "little")
    refused(header_case(tmp_path, big + b"{}"), "over safetensors' limit of 100000000")
    over = (MAX_HEADER_BYTES + 1).to_bytes(8, "little")
    refused(header_case(tmp_path, over), "over safetensors' limit")
    refused(header_case(tmp_path, (1000).to_bytes(8, "little") + b"{}"), "truncated")


E = GOOD["model.embed_tokens.weight"]


@pytest.mark.parametrize(
    ("header", "data", "words"),
    [
        (b"\xff\xfe{", bytes(128), ["header is not JSON"]),
        (b"[1]", bytes(128), ["not a JSON object"]),
        (b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": 1}', b"",
         ["duplicate key 'a'"]),
        ({"x": 5}, bytes(128), ["entry 'x' is not an object"]),
        ({"x": {**E, "dtype": "Q4"}}, bytes(128), ["unknown dtype 'Q4'"]),
        ({"x": {**E, "dtype": "I64", "shape": [16]}}, bytes(128), ["is I64", "bf16, fp16 or fp32"]),
        ({"x": {**E, "dtype": "F8_E4M3", "shape": [128]}}, bytes(128), ["no quantised checkpoints"]),
        ({"x": {**E, "shape": [4, -8]}}, bytes(128), ["no valid shape"]),
        ({"x": {**E, "shape": [4, 9]}}, bytes(128), ["[4, 9] of F32 (144 bytes)", "span 128"]),
        ({"x": {**E, "data_offsets": [64, 0]}}, bytes(128), ["no valid data_offsets"]),
        ({"x": E, "y": {**E, "data_offsets": [64, 192]}}, bytes(192), ["overlapping or gapped"]),
        ({"x": {**E, "data_offsets": [8, 136]}}, bytes(136), ["starts at data offset 8"]),
        (GOOD, bytes(200), ["hold 128 bytes but the file has 200"]),
        (GOOD, bytes(100), ["truncated"]),
        ({"x" * 10_000: {**E, "dtype": "Q4"}}, bytes(128), ["unknown dtype", "..."]),
        ({**GOOD, "__metadata__": {"a": 1}}, bytes(128), ["__metadata__ is not a map of strings"]),
    ],
)  # fmt: skip
def test_corrupt_headers(tmp_path, header, data, words):
    refused(model_dir(tmp_path, header=header, data=data), "model.safetensors", *words)


def index_case(tmp_path: Path, weight_map) -> Path:
    d = model_dir(tmp_path, name="model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def test_indexes_that_point_elsewhere_or_disagree(tmp_path):
    shard = "model-00001-of-00001.safetensors"
    assert describe(index_case(tmp_path, {"model.embed_tokens.weight": shard})).names
    refused(index_case(tmp_path, {"w": "../../etc/passwd.safetensors"}), "not a .safetensors file of this directory")  # fmt: skip
    refused(index_case(tmp_path, {"w": "other.safetensors"}), "copy the missing shards")
    refused(index_case(tmp_path, {}), "no 'weight_map'")
    refused(
        index_case(tmp_path, {"model.embed_tokens.weight": shard, "lm_head.weight": shard}),
        "'lm_head.weight' is mapped to",
        "is in no file",
    )


def test_a_tensor_in_two_files(tmp_path):
    d = model_dir(tmp_path)
    shutil.copy(d / "model.safetensors", d / "model-extra.safetensors")
    refused(d, "is in both", "remove the stray file")


def test_gps_gets_the_same_line(tmp_path):
    d = model_dir(tmp_path, header={"x": {**E, "dtype": "Q4"}})
    with pytest.raises(PivotError, match="unknown dtype 'Q4'"):
        ModelSpec.from_dir(d, name="genrm")
