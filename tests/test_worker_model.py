"""Our Llama implementation against Hugging Face's, through our loader and paged cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.worker.attention import AttentionMetadata, paged_attention, reference_attention
from kvpool.worker.attention_cpu import CpuPagedDecode
from kvpool.worker.attention_flex import FlexDecode, FlexUnavailable
from kvpool.worker.engine import EngineConfig, LLMEngine
from kvpool.worker.loader import load_model, load_tokenizer
from kvpool.worker.model_runner import ModelRunner
from kvpool.worker.scheduler import ScheduledBatch
from kvpool.worker.sequence import SamplingParams, Sequence

from conftest import build_hf_model

PROMPTS = [
    "A router in front of a pool of inference workers",
    "Each worker keeps its cache in fixed-size blocks.",
    "GPU, CPU, KV, TTFT, p99; questions end with a mark?",
    "x",
]

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama3-rope-tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-attention-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2-bias": ("qwen2", {}),
    # Qwen3-0.6B's shape in small: q/k norms, and a head_dim that is not hidden / heads
    "qwen3-qk-norm": ("qwen3", {"head_dim": 48, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    # Gemma 2B's traits in small: GELU MLP, scaled embeddings, norms stored as offsets from
    # 1 (random, so that a missing offset shows), tied embeddings, head_dim of its own
    "gemma": ("gemma", {"head_dim": 40, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_dir(request, tmp_path_factory) -> Path:
    architecture, overrides = VARIANTS[request.param]
    return build_hf_model(tmp_path_factory.mktemp(request.param), architecture, **overrides)


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _prompt_logits(model, token_ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through our runner and paged cache."""
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    seq = Sequence("r", list(token_ids), len(token_ids), SamplingParams(), None)  # type: ignore[arg-type]
    seq.block_ids = list(range(-(-len(token_ids) // 16)))
    meta = AttentionMetadata.build([len(token_ids)], [len(token_ids)], [seq.block_ids], 16, "cpu")
    hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), runner.kv_cache, meta)
    return model.compute_logits(hidden)


def test_prompt_logits_match_hugging_face(variant_dir: Path) -> None:
    ours = load_model(variant_dir, dtype="float32")
    hf = _hf(variant_dir)
    tokenizer = load_tokenizer(variant_dir)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = hf(torch.tensor([ids])).logits[0]
        got = _prompt_logits(ours, ids)
        assert (got - expected).abs().max().item() < 1e-4, prompt


def _assert_greedy_matches_hf(engine: LLMEngine, model_dir: Path, max_tokens: int) -> None:
    """The engine's greedy outputs for :data:`PROMPTS` are HF ``generate``'s, token for
    token."""
    hf = _hf(model_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for done in engine.generate(PROMPTS, params):
        ids = torch.tensor([done.prompt_token_ids])
        expected = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        assert done.token_ids == expected[0, ids.shape[1] :].tolist()


def test_greedy_generation_matches_hugging_face(variant_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(variant_dir, EngineConfig(num_blocks=64, device="cpu"))
    _assert_greedy_matches_hf(engine, variant_dir, max_tokens=32)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 40), st.integers(0, 40)),  # (new tokens, earlier context)
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
    gather=st.sampled_from([32768, 60]),  # 60: decode rows split into several gathers
)
def test_paged_attention_equals_the_plain_definition(rows, seed, gather) -> None:
    """Ragged batches mixing decode rows, fresh prefills and chunks on top of cached context,
    with blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    head_dim, block_size = 8, 4
    k_cache, v_cache, query_lens, seq_lens, tables, (q, k, v) = _scattered_batch(
        rows, gen, head_dim=head_dim, block_size=block_size
    )
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu", gather)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    expected = reference_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_long_decode_row_does_not_pad_the_short_ones_to_its_length() -> None:
    """Eight short chats decoding beside one long row (a hand-off's last token after 1,024
    cached tokens): the gather copies at most twice the context the rows use, not nine
    times the long row's (which made that step ten times slower)."""
    block_size = 16
    lens = [100] * 8 + [1025]
    tables = [list(range(i * 80, i * 80 + -(-n // block_size))) for i, n in enumerate(lens)]
    meta = AttentionMetadata.build([1] * 9, lens, tables, block_size, "cpu")
    gathered = sum(d.slots.numel() for d in meta.decode)
    assert gathered <= 2 * sum(lens)
    assert sorted(i for d in meta.decode for i in d.q_index.tolist()) == list(range(9))


def _scattered_batch(rows, gen, heads=4, kv_heads=2, head_dim=8, block_size=4, num_blocks=128):
    """A ragged batch over blocks scattered through a cache whose earlier context is random:
    ``rows`` are (new tokens, earlier context)."""
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    query_lens, seq_lens, tables = [], [], []
    for q, ctx in rows:
        total = q + ctx
        tables.append([order.pop() for _ in range(-(-total // block_size))])
        query_lens.append(q)
        seq_lens.append(total)
        slots = [tables[-1][i // block_size] * block_size + i % block_size for i in range(ctx)]
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(
                len(slots), kv_heads, head_dim, generator=gen
            )
    t = sum(query_lens)
    qkv = (
        torch.randn(t, heads, head_dim, generator=gen),
        torch.randn(t, kv_heads, head_dim, generator=gen),
        torch.randn(t, kv_heads, head_dim, generator=gen),
    )
    return k_cache, v_cache, query_lens, seq_lens, tables, qkv


@pytest.mark.parametrize(
    "rows",
    [
        # decode rows ending mid-block, on a block's last slot and in a block of their own,
        # beside a fresh prefill and a chunk on cached context (those take the other path)
        [(1, 22), (1, 15), (1, 16), (1, 0), (5, 0), (3, 40), (1, 70)],
        [(1, 47), (1, 2), (1, 90)],  # 3 rows: padded to a batch of 4
    ],
)
@pytest.mark.parametrize("kernel", [FlexDecode, CpuPagedDecode])
def test_the_paged_decode_path_reads_the_cache_in_place_and_agrees(rows, kernel) -> None:
    """Decode rows through a kernel that reads the block tables (FlexAttention; the C
    kernel): the same attention as the plain definition, while the gather path's padded
    copies are never built. (Head and block sizes as the engine's: inductor's CPU kernel
    takes 16 and up.)"""
    gen = torch.Generator().manual_seed(len(rows))
    k_cache, v_cache, query_lens, seq_lens, tables, (q, k, v) = _scattered_batch(
        rows, gen, head_dim=32, block_size=16, num_blocks=512
    )
    paged = kernel(k_cache.shape[0], 16, max_rows=8, max_blocks_per_seq=8, device="cpu")
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, "cpu", paged=paged)
    assert meta.decode == [] and meta.paged is paged  # no gathered decode batch
    assert paged.rows == sum(q == 1 for q, _ in rows)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 32**-0.5)
    expected = reference_attention(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


CHECKOUT = Path(__file__).resolve().parents[1]

#: FlexAttention on CPU in a process of its own, the shapes of the test above (so that a
#: warm inductor cache serves it), against the plain definition
FLEX_ON_CPU = """
import torch
from kvpool.worker.attention_flex import FlexDecode

gen = torch.Generator().manual_seed(0)
heads, kv_heads, head_dim, bs, num_blocks = 4, 2, 32, 16, 512
k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
lens = [48, 3, 91]
order = torch.randperm(num_blocks, generator=gen).tolist()
tables = [[order.pop() for _ in range(-(-n // bs))] for n in lens]
q = torch.randn(len(lens), heads, head_dim, generator=gen)
paged = FlexDecode(num_blocks, bs, max_rows=8, max_blocks_per_seq=8, device="cpu")
paged.plan(tables, lens)
got = paged.attend(q, k_cache, v_cache, head_dim**-0.5)
for i, (table, n) in enumerate(zip(tables, lens)):
    keys, values = (
        c[table].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, 1)
        for c in (k_cache, v_cache)
    )
    weights = torch.softmax(torch.einsum("hd,thd->ht", q[i], keys) * head_dim**-0.5, -1)
    expected = torch.einsum("ht,thd->hd", weights, values)
    torch.testing.assert_close(got[i], expected, atol=1e-5, rtol=1e-5)
print("agrees")
"""


@pytest.mark.slow  # a child Python compiles the kernel: up to minutes on a cold cache
def test_flex_attention_compiles_on_cpu_when_the_checkout_is_on_the_path() -> None:
    """Started in the checkout with the checkout on sys.path (``python -m`` there, without
    safe-path mode), a process hands inductor's child Pythons a path whose ``operator/``
    shadows the standard library's: its SIMD probe died, and FlexAttention's CPU kernel
    failed to compile (``remainder_integral expects integral scalar T``). A process of
    its own: inductor probes once per process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONSAFEPATH", "TORCH_CUSTOM_PYTHONPATH")
    }
    done = subprocess.run(
        [sys.executable, "-c", FLEX_ON_CPU],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "agrees"


def test_flex_attention_is_refused_at_start_where_inductor_has_no_cpu_simd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where inductor can build no vectorised C++ (no compiler, say), the worker stops at
    start with what to do instead, not at its first decode step with a C++ error."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: cpu_vec_isa.invalid_vec_isa)
    with pytest.raises(FlexUnavailable, match="--attention paged"):
        FlexDecode(64, 16, max_rows=4, max_blocks_per_seq=4, device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)])
def test_the_cpu_kernel_reads_half_precision_caches_and_grouped_heads(
    dtype, heads, kv_heads
) -> None:
    """The C kernel on a bfloat16 or float16 cache (converted as it reads, accumulated in
    float32), with 4, 1 and 6 query heads per KV head: the plain definition's answer to
    the half-precision rounding."""
    rows = [(1, 37), (1, 0), (1, 63), (1, 200)]
    gen = torch.Generator().manual_seed(heads * kv_heads)
    k_cache, v_cache, query_lens, seq_lens, tables, (q, k, v) = _scattered_batch(
        rows, gen, heads=heads, kv_heads=kv_heads, head_dim=64, block_size=16, num_blocks=64
    )
    k_cache, v_cache, q, k, v = (t.to(dtype) for t in (k_cache, v_cache, q, k, v))
    paged = CpuPagedDecode(64, 16, max_rows=4, max_blocks_per_seq=16, device="cpu")
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, "cpu", paged=paged)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 64**-0.5)
    expected = reference_attention(q, k_cache, v_cache, meta, 64**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_the_cpu_kernel_stays_finite_when_scores_are_large() -> None:
    """Scores in the hundreds (a sharp attention head): the online softmax subtracts each
    running maximum, so nothing overflows, and the answer is still the definition's."""
    rows = [(1, 90), (1, 31)]
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, query_lens, seq_lens, tables, (q, k, v) = _scattered_batch(
        rows, gen, heads=4, kv_heads=2, head_dim=32, block_size=16, num_blocks=32
    )
    q = q * 60  # scores of a few hundred at scale 32**-0.5
    paged = CpuPagedDecode(32, 16, max_rows=2, max_blocks_per_seq=8, device="cpu")
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, "cpu", paged=paged)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 32**-0.5)
    assert torch.isfinite(got).all()
    expected = reference_attention(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_cpu_kernel_refuses_a_table_that_points_outside_the_cache() -> None:
    """A block id beyond the cache is an error the engine sees, not a read of memory that
    is not the cache's."""
    paged = CpuPagedDecode(8, 16, max_rows=2, max_blocks_per_seq=4, device="cpu")
    k_cache = torch.zeros(8, 16, 2, 16)
    paged.plan([[3, 9]], [20])  # block 9 of 8
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged.attend(torch.zeros(1, 4, 16), k_cache, torch.zeros_like(k_cache), 0.25)
    with pytest.raises(ValueError, match="needs 2 blocks; it has 1"):
        paged.plan([[3]], [20])
    paged.plan([[3, 4]], [20])
    with pytest.raises(ValueError, match="blocks of 8 tokens, head size 16"):  # not its cache
        small = torch.zeros(8, 8, 2, 16)
        paged.attend(torch.zeros(1, 4, 16), small, torch.zeros_like(small), 0.25)


def test_the_paged_path_is_chosen_by_name_and_auto_follows_the_device(llama_dir: Path) -> None:
    model = load_model(llama_dir)
    assert isinstance(ModelRunner(model, 16, 16, attention="paged").paged, CpuPagedDecode)
    assert ModelRunner(model, 16, 16, attention="gather").paged is None
    assert isinstance(ModelRunner(model, 16, 16, attention="flex").paged, FlexDecode)
    assert EngineConfig().resolved_attention(torch.device("cpu")) == "gather"
    assert EngineConfig().resolved_attention(torch.device("cuda")) == "paged"
    with pytest.raises(ValueError, match="not one of gather, paged"):
        ModelRunner(model, 16, 16, attention="flash")


def test_greedy_generation_on_the_paged_path_matches_hugging_face(llama_dir: Path) -> None:
    config = EngineConfig(num_blocks=64, device="cpu", attention="paged", max_num_seqs=8)
    engine = LLMEngine.from_pretrained(llama_dir, config)
    assert isinstance(engine.runner.paged, CpuPagedDecode)
    _assert_greedy_matches_hf(engine, llama_dir, max_tokens=24)


def test_runner_returns_logits_only_for_sequences_due_a_token(llama_dir: Path) -> None:
    model = load_model(llama_dir)
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    whole = Sequence("a", list(range(5, 25)), 20, SamplingParams(), None)  # type: ignore[arg-type]
    chunk = Sequence("b", list(range(5, 45)), 40, SamplingParams(), None)  # type: ignore[arg-type]
    whole.block_ids, chunk.block_ids = [0, 1], [2, 3, 4]
    logits, sampled = runner.execute(ScheduledBatch([whole, chunk], [20, 16]))
    assert sampled == [0]  # the chunked prompt has 24 tokens to go
    assert logits.shape == (1, model.config.vocab_size)


def test_a_sliding_window_caps_the_context(tmp_path) -> None:
    """Attention here is always full, so a Mistral v0.1 model stops at its window."""
    model_dir = build_hf_model(tmp_path, "mistral", sliding_window=48)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(num_blocks=64, device="cpu"))
    assert engine.max_model_len == 48
    with pytest.raises(ValueError, match="context is 48"):
        engine.add_request(list(range(3, 60)))
