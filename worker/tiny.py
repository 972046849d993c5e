"""A deterministic tiny random Llama model and a tokenizer, written as a real Hugging Face
model directory, for tests and the local demo. No download: the tokenizer is trained here
on the text below, and the weights come from a seeded generator.

The words it produces are meaningless; everything else about it (config, safetensors,
tokenizer, chat template, GQA, RoPE) is what a real checkpoint has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = """\
A router in front of a pool of inference workers reads every prompt, cuts it into blocks
of sixteen tokens, and hashes each block together with the hash of the block before it.
Two prompts that share a beginning share their first hashes, so the router can ask which
worker already holds the keys and values for the longest part of a new prompt. The worker
that holds them skips that part of the prefill and answers sooner; the time to first token
drops, and the pool serves more requests with the same hardware.
Each worker keeps its cache in fixed-size blocks. A block that no request uses any more
stays in memory with its hash until the space is needed, in least recently used order, so
a popular system prompt survives while rare ones make way. When a block is stored or
evicted, the worker publishes an event; the router's index follows those events.
The scheduler runs requests in continuous batches. Long prompts are split into chunks so
that a huge prefill does not stall the tokens of requests that are already decoding. When
memory runs out, the newest request is preempted and recomputed later from its tokens.
Operators describe a pool in one manifest: the model, the number of prefill and decode
workers, the targets for latency, and the limits of autoscaling. The operator turns the
manifest into deployments, services and a router, and keeps them true as the spec changes.
Numbers, names and punctuation appear too: 0 1 2 3 4 5 6 7 8 9, GPU, CPU, KV, TTFT, p99;
questions end with a mark? Lists use commas, colons: and semicolons; quotes "like this".
"""

BOS, EOS, END_OF_TURN = "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: the default shape: small enough for 2 CPU cores, big enough that compute is not noise
DEFAULT_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def write_tokenizer(model_dir: str | Path, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer on :data:`CORPUS` and save it with a chat template.
    Returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, END_OF_TURN, *ROLES],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
    )
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(model_dir))
    return fast


#: transformers' config and model class names for each architecture a random model can have
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}


def hf_model_classes(architecture: str) -> tuple[Any, Any]:
    """transformers' config and model classes for ``architecture`` (imported on demand)."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    return tuple(getattr(transformers, name) for name in ARCHITECTURES[architecture])


def make_tiny_model(
    model_dir: str | Path,
    *,
    seed: int = 0,
    architecture: str = "llama",
    **shape: Any,
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer.

    ``architecture`` is one of :data:`ARCHITECTURES` (``qwen2`` has q/k/v biases);
    ``shape`` overrides :data:`DEFAULT_SHAPE` and any other config field.
    """
    import torch

    config_cls, model_cls = hf_model_classes(architecture)
    model_dir = Path(model_dir)
    tokenizer = write_tokenizer(model_dir)
    fields = {
        **DEFAULT_SHAPE,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        **shape,
    }
    config = config_cls(**fields)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_cls(config).to(torch.float32)
        # Random weights at the usual 0.02 give near-uniform logits; a wider spread gives
        # the peaked distributions of a trained model, so greedy decoding has clear winners.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(str(model_dir))
    (model_dir / "kvpool-tiny.json").write_text(
        json.dumps({"seed": seed, "architecture": architecture, **shape}, sort_keys=True) + "\n"
    )
    return model_dir
