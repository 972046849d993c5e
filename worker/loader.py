"""Load a Hugging Face model directory: ``config.json``, ``*.safetensors`` (one file or
sharded with ``model.safetensors.index.json``), and the tokenizer with its chat template.

Every failure names the file and the tensor, since a half-loaded model that runs is worse
than one that refuses to start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from kvpool import tokenization

from .config import DTYPES, ModelConfig, ModelLoadError
from .model import LlamaModel, Rotary

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (fast kernels there), the checkpoint's own dtype on a GPU
    (bfloat16 when the checkpoint is float32)."""
    if name != "auto":
        if name not in DTYPES:
            raise ModelLoadError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = DTYPES.get(config.torch_dtype or "", torch.bfloat16)
    return torch.bfloat16 if saved is torch.float32 else saved


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise ModelLoadError(f"{index} names {path.name}, which is missing")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
    files = {}
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                files[name] = path
    return files


def load_model(
    model_dir: str | Path, dtype: str = "auto", device: str | torch.device = "cpu"
) -> LlamaModel:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = LlamaModel(config)
    # cast while still on meta, so the device only ever holds the model in its final dtype
    model = model.to(torch_dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(config).to(device)
    params = dict(model.named_parameters())
    files = weight_files(model_dir)
    targets = model.weight_map()
    missing = sorted(set(targets) - set(files))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{model_dir}: tensor {missing[0]!r} is missing{more}")
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in names:
                target = targets[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != target.shape:
                    raise ModelLoadError(
                        f"{path.name}: tensor {name!r} has shape {list(shape)}, "
                        f"config.json implies {list(target.shape)}"
                    )
                tensor = f.get_tensor(name).to(torch_dtype)
                param = params[target.param]
                with torch.no_grad():
                    (param if target.rows is None else param[target.rows]).copy_(tensor)
    ignored = sorted(set(files) - set(targets))
    if ignored:
        log.debug("ignored %d checkpoint tensors, e.g. %s", len(ignored), ignored[0])
    return model.eval()


def load_tokenizer(model_dir: str | Path):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer and chat template stored beside the weights (the router loads them
    with the same function)."""
    try:
        return tokenization.load_tokenizer(model_dir)
    except tokenization.TokenizerError as exc:
        raise ModelLoadError(str(exc)) from None
