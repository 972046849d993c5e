"""Loading model directories: formats, dtypes, and the errors a bad directory gets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpool.worker.config import ModelLoadError
from kvpool.worker.engine import EngineConfig, LLMEngine
from kvpool.worker.loader import load_model, load_tokenizer
from kvpool.worker.sequence import SamplingParams

from conftest import build_hf_model

PROMPT = [5, 17, 33, 60, 2, 99, 140]


def greedy(model_dir: Path, **config) -> list[int]:
    engine = LLMEngine.from_pretrained(
        model_dir, EngineConfig(num_blocks=16, device="cpu", **config)
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].token_ids


@pytest.fixture
def model_copy(llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def test_a_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path, llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(str(llama_dir)).save_pretrained(
        str(sharded), max_shard_size="100KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert greedy(sharded) == greedy(llama_dir)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_mostly_agrees(llama_dir: Path, dtype: str) -> None:
    model = load_model(llama_dir, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    ours = greedy(llama_dir, dtype=dtype)
    reference = greedy(llama_dir, dtype="float32")
    assert ours[:3] == reference[:3]  # rounding may split later near-ties, not the start


def test_an_unsupported_architecture_is_named(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(model_copy)


def test_a_missing_tensor_is_named(model_copy: Path) -> None:
    path = model_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(
        ModelLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    ):
        load_model(model_copy)


def test_a_misshapen_tensor_is_named_with_both_shapes(model_copy: Path) -> None:
    path = model_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight' has shape \[64, 64\].*\[32, 64\]"):
        load_model(model_copy)


def test_a_missing_tokenizer_is_reported(model_copy: Path) -> None:
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_tokenizer(model_copy)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        LLMEngine.from_pretrained(model_copy, EngineConfig(num_blocks=4, device="cpu"))


def test_missing_weights_and_config_are_reported(tmp_path: Path, model_copy: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(model_copy)


def test_an_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported RoPE scaling 'yarn'"):
        build_hf_model(
            tmp_path,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        load_model(tmp_path)


def test_make_tiny_model_writes_the_same_model_every_time(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("kvpool")
    for name in ("a", "b"):
        out = subprocess.run(
            [str(exe), "worker", "make-tiny-model", str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "wrote a tiny random llama model" in out.stdout
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    out = subprocess.run(
        [
            str(exe),
            "worker",
            "generate",
            "--model",
            str(tmp_path / "a"),
            "the pool",
            "--max-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    line = json.loads(out.stdout)
    assert len(line["token_ids"]) == 5 and line["finish"] == "length"
