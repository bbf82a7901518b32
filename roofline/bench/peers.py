"""Peers measured in the same run as roofline: HF transformers (on the very same weights) and,
on the CPU, llama.cpp through llama-cpp-python on the same GGUF file."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from roofline.bench.workloads import Workload


@dataclass
class PeerResult:
    name: str
    output_tokens: int
    elapsed_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def hf_model_from_engine(engine):
    """An HF model holding exactly the weights roofline runs (unpacked from its fused layers)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**_hf_config_dict(engine.model_config))
    with torch.device(engine.runner.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=engine.runner.dtype)
    missing, unexpected = model.load_state_dict(
        export_hf_state_dict(engine.runner.model), strict=False
    )
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(
            f"weights do not map onto HF: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return model.eval()


def _hf_config_dict(model_config) -> dict:
    d = dict(model_config.hf_config)
    arch = model_config.architecture
    model_types = {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "MixtralForCausalLM": "mixtral",
    }
    d.setdefault("model_type", model_types.get(arch, "llama"))
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    return d


def export_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """roofline parameter names -> HF names, splitting the packed qkv / gate_up weights."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary"):
            continue
        hf = name if name.startswith("lm_head") else f"model.{name}"
        if ".qkv_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            parts = tensor.split([attn.q_size, attn.kv_size, attn.kv_size])
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[hf.replace("qkv_proj", proj)] = part
        elif name.endswith(".mlp.w13_weight"):  # MoE: transformers 5's stacked experts
            out[hf.replace("w13_weight", "experts.gate_up_proj")] = tensor
        elif name.endswith(".mlp.w2_weight"):
            out[hf.replace("w2_weight", "experts.down_proj")] = tensor
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            out[hf.replace("gate_up_proj", "gate_proj")] = gate
            out[hf.replace("gate_up_proj", "up_proj")] = up
        else:
            out[hf] = tensor
    if model.lm_head is None:
        out["lm_head.weight"] = model.embed_tokens.weight
    return out


@torch.inference_mode()
def hf_generate(model, workload: Workload, batch_size: int) -> PeerResult:
    """HF ``generate``: static batches of ``batch_size`` left-padded prompts, greedy, no EOS."""
    device = next(model.parameters()).device
    out_tokens, start = 0, time.perf_counter()
    for i in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[i : i + batch_size]
        new = max(workload.output_lens[i : i + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        out_tokens += (gen.shape[1] - width) * len(prompts)
    return PeerResult(f"hf generate (batch {batch_size})", out_tokens, time.perf_counter() - start)


def hf_generate_batch(model, workload: Workload, max_batch_tokens: int = 8192) -> PeerResult:
    """HF transformers' continuous batching (``generate_batch``), greedy, no EOS stop."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=max(workload.output_lens),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
        max_batch_tokens=max_batch_tokens,
    )
    start = time.perf_counter()
    # no inference_mode here: HF's batching thread updates its own buffers in place
    with torch.no_grad():
        results = model.generate_batch(
            inputs=workload.prompts, generation_config=cfg, progress_bar=False
        )
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(r.generated_tokens) for r in results.values())
    return PeerResult("hf generate_batch", out_tokens, elapsed)


def llamacpp(gguf_path: str, workload: Workload, threads: int = 2) -> PeerResult:
    """llama.cpp via llama-cpp-python, serving the requests one after another."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_threads=threads, n_ctx=4096, verbose=False)
    eos = llm.token_eos()
    out_tokens, start = 0, time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens):
        res = llm.create_completion(prompt, max_tokens=n, temperature=0.0, logit_bias={eos: -1e9})
        out_tokens += res["usage"]["completion_tokens"]
    return PeerResult(
        f"llama.cpp ({threads} threads, sequential)", out_tokens, time.perf_counter() - start
    )


def llamacpp_decode_tok_s(
    gguf_path: str, prompt: list[int], num_tokens: int, threads: int = 2
) -> float:
    """Batch-1 decode rate of llama.cpp: tokens after the first over the time after the first."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_threads=threads, n_ctx=4096, verbose=False)
    eos = llm.token_eos()
    stamps = []
    for _ in llm.create_completion(
        prompt, max_tokens=num_tokens, temperature=0.0, logit_bias={eos: -1e9}, stream=True
    ):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


@torch.inference_mode()
def hf_decode_tok_s(model, prompt: list[int], num_tokens: int) -> float:
    """Batch-1 decode rate of HF ``generate`` (prefill time taken out)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    t0 = time.perf_counter()
    model.generate(
        input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0
    )
    t1 = time.perf_counter()
    model.generate(
        input_ids=ids,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    t2 = time.perf_counter()
    return (num_tokens - 1) / ((t2 - t1) - (t1 - t0))
