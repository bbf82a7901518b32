"""Builds the engine's :class:`SpecDecoder` from a validated :class:`SpeculativeConfig`.

Every check that can refuse the configuration (k against the context, the draft's vocabulary
and tokenizer against the target's) runs before any weights are read. A draft model is loaded
through the target's loaders (HF folder, GGUF, config with dummy weights) into its own
:class:`ModelRunner`; on CUDA its KV pool gets the draft's share of the memory left for KV
caches (by bytes per token), and the target's pool, sized afterwards, sees what it took.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from roofline.config import CacheConfig, ModelConfig, SchedulerConfig
from roofline.models.weights import iter_weights, load_model_config, load_tokenizer, resolve_model
from roofline.spec_decode.adaptive import ASSUMED_ACCEPTANCE, batch_threshold
from roofline.spec_decode.config import SpeculativeConfig
from roofline.spec_decode.decoder import SpecDecoder
from roofline.spec_decode.draft_model import DraftModelProposer
from roofline.spec_decode.ngram import NgramProposer
from roofline.spec_decode.oracle import OracleProposer
from roofline.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _check_tokenizers(target: Any, draft: Any) -> None:
    if target is None or draft is None:
        return  # config-only models: the vocabulary sizes were compared
    if target.get_vocab() != draft.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the target's")


def build_spec_decoder(
    config: SpeculativeConfig,
    args: Any,
    target_config: ModelConfig,
    target_tokenizer: Any,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> SpecDecoder:
    config.check_context(scheduler_config.max_model_len)
    k = config.num_speculative_tokens
    draft_config: ModelConfig | None = None
    alpha = ASSUMED_ACCEPTANCE
    if config.method == "ngram":
        proposer: Any = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "oracle":
        alpha = config.acceptance_rate
        proposer = OracleProposer(k, alpha, target_config.vocab_size, config.seed)
    else:
        source = resolve_model(config.model)
        draft_config = load_model_config(source)
        if draft_config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({draft_config.vocab_size} tokens) differs from the "
                f"target's ({target_config.vocab_size})"
            )
        _check_tokenizers(target_tokenizer, load_tokenizer(source))
        dummy = args.load_format == "dummy" or source.kind == "config"
        runner = ModelRunner(
            draft_config,
            _draft_cache_config(args, target_config, draft_config, device, dtype),
            scheduler_config,
            device,
            dtype,
            weights=None if dummy else iter_weights(source),
            seed=args.seed + 1,
            attention_backend=_backend(args.attention_backend, device),
        )
        runner.warmup()
        if device.type == "cuda" and not args.enforce_eager:
            runner.capture_cuda_graphs()
        proposer = DraftModelProposer(runner, k)
    max_batch = config.disable_by_batch_size
    if max_batch is None and (device.type != "cuda" or args.enforce_eager):
        max_batch = batch_threshold(
            target_config, draft_config, device, alpha, k, scheduler_config.max_num_seqs, dtype
        )
        logger.info("speculative decoding while at most %d requests run (roofline)", max_batch)
    elif max_batch is None:  # CUDA graphs: the adaptive switch decides (SpecDecoder.prepare)
        max_batch = scheduler_config.max_num_seqs
    return SpecDecoder(config, proposer, max_batch, scheduler_config.max_model_len, alpha)


def _backend(name: str, device: torch.device) -> Any:
    from roofline.engine.llm_engine import _make_backend  # the engine's own choice

    return _make_backend(name, device)


def _draft_cache_config(
    args: Any,
    target: ModelConfig,
    draft: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> CacheConfig:
    base: CacheConfig = args.cache_config()
    if device.type != "cuda" or base.num_pages_override or base.kv_cache_memory_bytes:
        return base  # same page count (override) or the same fixed budget
    free, total = torch.cuda.mem_get_info(device)
    size = dtype.itemsize
    weights = (target.num_params() + draft.num_params()) * size
    kv_total = int(total * base.gpu_memory_utilization) - (total - free) - weights - (2 << 30)
    per_token_draft = draft.kv_bytes_per_token(size)
    share = per_token_draft / (per_token_draft + target.kv_bytes_per_token(size))
    if kv_total <= 0:
        raise ValueError("no GPU memory left for the draft's KV cache")
    return CacheConfig(
        page_size=base.page_size,
        kv_cache_memory_bytes=int(kv_total * share),
        enable_prefix_caching=False,
    )
