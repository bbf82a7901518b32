"""The C decode step (``kernels/cpu/decoder.c``) against the model's own modules on the same tiny
GGUF-block model: hidden states, the K/V it stores, for Llama, Qwen2 (q/k/v bias) and Qwen3
(q/k norm) layers; and batch invariance: a request's row is bit-identical alone or in a batch."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import make_paged

from roofline.attention.metadata import AttentionMetadata
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.config import ModelConfig
from roofline.kernels.cpu import decoder as decoder_mod
from roofline.kernels.cpu.build import ISA_NAMES, load_library
from roofline.kernels.cpu.build import best_isa as build_isa
from roofline.kernels.cpu.decoder import CPUDecoder, build_cpu_decoder
from roofline.layers.attention import ForwardContext
from roofline.models.llama import LlamaForCausalLM
from roofline.quantization.base import QuantizationConfig
from roofline.quantization.gguf_cpu import GGUFBlocksLinearMethod
from roofline.quantization.kv_cache import KVCacheSpec

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler")

PAGE_SIZE = 8


class AllBlocks(QuantizationConfig):
    """Every linear layer keeps Q8_0 (or Q4_0) blocks, quantized from random floats."""

    name = "test-blocks"

    def __init__(self, fmt: str = "Q8_0") -> None:
        self.fmt = fmt

    def get_linear_method(self, prefix: str) -> GGUFBlocksLinearMethod:
        return GGUFBlocksLinearMethod(self.fmt)


HEADS = {16: (4, 2), 64: (3, 1)}
"""head_dim -> (query heads, KV heads): 64 is SmolLM2's head size and group of 3 (the
attention kernel's specialized path), 16 the generic one."""


def tiny_model(
    bias: bool = False, qk_norm: bool = False, seed: int = 0, head_dim: int = 16
) -> LlamaForCausalLM:
    heads, kv_heads = HEADS[head_dim]
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=bias,
        qk_norm=qk_norm,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg, 64, quant_config=AllBlocks())
    weights = []
    for name, param in model.named_parameters():
        if name.endswith("qkv_proj.bias"):
            layer = name.removesuffix("qkv_proj.bias")
            q_size, kv_size = heads * head_dim, kv_heads * head_dim
            for part, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                weights.append((f"{layer}{part}_proj.bias", torch.randn(size, generator=gen)))
            continue
        weights.append((name, torch.rand(param.shape, generator=gen) + 0.5 if "norm" in name else
                        torch.randn(param.shape, generator=gen) * 0.3))  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, rows, cols in [
            ("self_attn.q_proj", heads * head_dim, 64),
            ("self_attn.k_proj", kv_heads * head_dim, 64),
            ("self_attn.v_proj", kv_heads * head_dim, 64),
            ("self_attn.o_proj", 64, heads * head_dim),
            ("mlp.gate_proj", 96, 64),
            ("mlp.up_proj", 96, 64),
            ("mlp.down_proj", 64, 96),
        ]:
            weights.append((p + name + ".weight", torch.randn(rows, cols, generator=gen) * 0.2))
    model.load_weights(weights)
    model.process_weights_after_loading()
    assert isinstance(model.cpu_decoder, CPUDecoder)
    return model.eval()


def decode_inputs(context_lens: list[int], seed: int = 1, head_dim: int = 16):
    """A decode step of len(context_lens) requests over random cached K/V (2 layers)."""
    return step_inputs([1] * len(context_lens), context_lens, seed, head_dim)


def step_inputs(query_lens: list[int], context_lens: list[int], seed: int = 1, head_dim: int = 16):
    """A step of requests with ``query_lens`` new rows after ``context_lens`` cached ones over
    random cached K/V (2 layers)."""
    layers = []
    for layer in range(2):
        heads, kv_heads = HEADS[head_dim]
        b = make_paged(query_lens, context_lens, heads, kv_heads, head_dim,
                       PAGE_SIZE, torch.float32, seed=seed + layer)  # fmt: skip
        layers.append(b)
    b = layers[0]
    meta = AttentionMetadata(
        num_reqs=len(context_lens),
        num_tokens=sum(query_lens),
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        slot_mapping=b.slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=max(b.seq_lens_list),
        page_size=PAGE_SIZE,
        query_start_loc_cpu=b.query_start_loc.tolist(),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(b.seq_lens_list),
    )
    caches = [(layers[0].k_cache, layers[0].v_cache), (layers[1].k_cache.clone(),
              layers[1].v_cache.clone())]  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, 96, (sum(query_lens),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    return ids, positions, meta, caches


def one_request(inputs, i: int):
    """Request ``i`` of a step's inputs as a step of its own (the same caches)."""
    ids, positions, meta, caches = inputs
    rows = slice(meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1])
    q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
    alone = AttentionMetadata(
        num_reqs=1,
        num_tokens=q_len,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=meta.seq_lens[i : i + 1],
        block_table=meta.block_table[i : i + 1],
        slot_mapping=meta.slot_mapping[rows],
        max_query_len=q_len,
        max_seq_len=seq_len,
        page_size=PAGE_SIZE,
        query_start_loc_cpu=[0, q_len],
        query_lens_cpu=[q_len],
        seq_lens_cpu=[seq_len],
    )
    return (ids[rows], positions[rows], alone, caches), rows


def run(model: LlamaForCausalLM, fused: bool, ids, positions, meta, caches):
    caches = [tuple(t.clone() for t in kv) for kv in caches]
    ctx = ForwardContext(meta, caches, TorchAttentionBackend())
    decoder = model.cpu_decoder
    model.cpu_decoder = decoder if fused else None
    try:
        with torch.inference_mode():
            hidden = model(ids, positions, ctx)
    finally:
        model.cpu_decoder = decoder
    return hidden, caches


@pytest.mark.parametrize(
    "bias,qk_norm,head_dim",
    [(False, False, 16), (True, False, 16), (False, True, 16), (False, False, 64)],
)
def test_decoder_matches_modules(bias: bool, qk_norm: bool, head_dim: int) -> None:
    model = tiny_model(bias, qk_norm, head_dim=head_dim)
    inputs = decode_inputs([0, 5, 17, 30, 41], head_dim=head_dim)
    want, want_caches = run(model, False, *inputs)
    got, got_caches = run(model, True, *inputs)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        torch.testing.assert_close(gk, wk, rtol=5e-4, atol=5e-4)
        torch.testing.assert_close(gv, wv, rtol=5e-4, atol=5e-4)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512vnni"])
def test_decoder_vector_paths_match_modules(isa: str) -> None:
    """Each vector path this CPU runs (the GEMMs' and attention's: AVX2 machines run the
    generic attention) gives a prefill + decode step the modules' hidden states."""
    if ISA_NAMES.index(isa) > ISA_NAMES.index(build_isa()):
        pytest.skip(f"this CPU does not run {isa}")
    model = tiny_model(head_dim=64)
    decoder = model.cpu_decoder
    decoder._config_values[decoder_mod.CONFIG_FIELDS.index("isa")] = ISA_NAMES.index(isa)
    decoder._kv_key = None  # rebuild the config table
    inputs = step_inputs([1, 5, 1], [7, 0, 19], head_dim=64)
    want, _ = run(model, False, *inputs)
    got, _ = run(model, True, *inputs)
    torch.testing.assert_close(got, want, rtol=5e-4, atol=5e-4)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_decoder_rows_are_batch_invariant(head_dim: int) -> None:
    """Rows alone (the GEMMs' 16-weight-row kernel) equal the batch's (its 16-row tiles)."""
    model = tiny_model(head_dim=head_dim)
    context_lens = [3, 40, 11, 0, 25, 7]
    ids, positions, meta, caches = decode_inputs(context_lens, head_dim=head_dim)
    batched, _ = run(model, True, ids, positions, meta, caches)
    for i in range(len(context_lens)):
        one = AttentionMetadata(
            num_reqs=1,
            num_tokens=1,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=meta.seq_lens[i : i + 1],
            block_table=meta.block_table[i : i + 1],
            slot_mapping=meta.slot_mapping[i : i + 1],
            max_query_len=1,
            max_seq_len=meta.seq_lens_cpu[i],
            page_size=PAGE_SIZE,
            query_start_loc_cpu=[0, 1],
            query_lens_cpu=[1],
            seq_lens_cpu=[meta.seq_lens_cpu[i]],
        )
        alone, _ = run(model, True, ids[i : i + 1], positions[i : i + 1], one, caches)
        assert torch.equal(alone[0], batched[i]), f"request {i} differs alone"


@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_step_rows_equal_their_own_steps(head_dim: int) -> None:
    """A mixed step (decodes beside a prefill chunk, as a server's step under load) gives each
    request's rows the bits of that request alone; else greedy tokens depend on the batch."""
    model = tiny_model(head_dim=head_dim)
    mixed = step_inputs([1, 6, 1], [9, 2, 20], head_dim=head_dim)
    batched, batched_caches = run(model, True, *mixed)
    for i in range(3):
        alone_inputs, rows = one_request(mixed, i)
        alone, alone_caches = run(model, True, *alone_inputs)
        assert torch.equal(batched[rows], alone), f"request {i} differs from its own step"
        slots = alone_inputs[2].slot_mapping
        for (bk, bv), (ak, av) in zip(batched_caches, alone_caches):
            for b, a in ((bk, ak), (bv, av)):
                assert torch.equal(b.flatten(0, 1)[slots], a.flatten(0, 1)[slots])


@pytest.mark.skipif(build_isa() != "avx512vnni", reason="fp16 pages: the AVX-512 attention")
def test_fp16_pages_match_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 KV pages (the decoder's opt-in on AVX-512): a decode + prefill step stores the same
    fp16 K/V as the modules' path (torch's rounding) and matches its hidden states."""
    model = tiny_model(head_dim=64)
    ids, positions, meta, caches = step_inputs([1, 7, 1], [12, 0, 30], head_dim=64)
    caches = [tuple(t.half() for t in kv) for kv in caches]
    spec = KVCacheSpec.create("auto", torch.float32)
    assert not model.cpu_decoder.wants_half_pages(spec)  # off by default
    monkeypatch.setenv("ROOFLINE_CPU_KV_HALF", "1")
    assert model.cpu_decoder.wants_half_pages(spec)
    want, want_caches = run(model, False, ids, positions, meta, caches)
    got, got_caches = run(model, True, ids, positions, meta, caches)
    torch.testing.assert_close(got, want, rtol=5e-4, atol=5e-4)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        assert gk.dtype == torch.float16
        torch.testing.assert_close(gk, wk, rtol=2e-3, atol=2e-3)  # one fp16 ulp
        torch.testing.assert_close(gv, wv, rtol=2e-3, atol=2e-3)


def test_half_pages_spec() -> None:
    spec = KVCacheSpec.create("auto", torch.float32).with_half_pages()
    assert spec.page_dtype == torch.float16 and not spec.quantized
    assert spec.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 64 * 2
    int8 = KVCacheSpec.create("int8", torch.float32)
    assert int8.with_half_pages() is int8  # quantized pages stay as asked


def test_not_built_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    monkeypatch.setenv("ROOFLINE_CPU_DECODER", "0")
    assert build_cpu_decoder(model) is None
    monkeypatch.delenv("ROOFLINE_CPU_DECODER")
    assert build_cpu_decoder(model) is not None
    inputs = decode_inputs([4, 9])
    meta = inputs[2]
    meta.uniform_query_len = 2  # a verification step keeps the module path
    ctx = ForwardContext(meta, inputs[3], TorchAttentionBackend())
    assert not model.cpu_decoder.applies(ctx) and not model.cpu_decoder.splits(ctx)
    # a prompt chunk wholly past PREFILL_POSITIONS: the modules
    ids, positions, meta, caches = step_inputs([3], [decoder_mod.PREFILL_POSITIONS])
    ctx = ForwardContext(meta, caches, TorchAttentionBackend())
    assert not model.cpu_decoder.applies(ctx) and not model.cpu_decoder.splits(ctx)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_prefill_rows_match_modules(head_dim: int) -> None:
    """Short prompts' rows (fresh, and after a cached context) run in the decoder, each over its
    own prefix, beside a decode row: hidden states and stored K/V match the modules'."""
    model = tiny_model(head_dim=head_dim)
    inputs = step_inputs([6, 9, 1], [0, 3, 20], head_dim=head_dim)
    ctx = ForwardContext(inputs[2], inputs[3], TorchAttentionBackend())
    assert model.cpu_decoder.applies(ctx)
    want, want_caches = run(model, False, *inputs)
    got, got_caches = run(model, True, *inputs)
    torch.testing.assert_close(got, want, rtol=5e-4, atol=5e-4)  # fp32 rounding, 2 layers
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        torch.testing.assert_close(gk, wk, rtol=5e-4, atol=5e-4)
        torch.testing.assert_close(gv, wv, rtol=5e-4, atol=5e-4)


def test_long_prompt_rows_split_at_prefill_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk across PREFILL_POSITIONS: its early rows run in the decoder, the later ones in
    the modules after them (attending to the early rows' K/V); the rows match the modules'
    path and are bit-identical to the request's own step."""
    monkeypatch.setattr(decoder_mod, "PREFILL_POSITIONS", 8)
    model = tiny_model(head_dim=64)
    inputs = step_inputs([1, 12, 5], [9, 2, 0], head_dim=64)
    ctx = ForwardContext(inputs[2], inputs[3], TorchAttentionBackend())
    assert not model.cpu_decoder.applies(ctx) and model.cpu_decoder.splits(ctx)
    want, _ = run(model, False, *inputs)
    got, _ = run(model, True, *inputs)
    torch.testing.assert_close(got, want, rtol=5e-4, atol=5e-4)
    for i in range(3):
        alone_inputs, rows = one_request(inputs, i)
        alone, _ = run(model, True, *alone_inputs)
        assert torch.equal(got[rows], alone), f"request {i} differs from its own step"


def test_out_of_range_token_is_refused() -> None:
    model = tiny_model()
    ids, positions, meta, caches = decode_inputs([3, 5])
    ids[1] = 96  # the vocabulary is 96 rows
    with pytest.raises(IndexError, match="out of range"):
        run(model, True, ids, positions, meta, caches)
