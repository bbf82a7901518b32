"""Host time per decode step, without a GPU: what async scheduling has to hide behind the device.

Two measurements at ``--num-reqs`` running requests (prompts uniform in ``--input-len``):

1. the step's host pieces with no model at all: ``Scheduler.schedule()``, the runner's host
   batch (``HostBatch.build``), its upload with the block-table updates applied and the batch's
   table gathered, and ``Scheduler.update()`` (median over ``--steps`` decode steps);
2. an ``LLMEngine`` on the CPU with a tiny random 2-layer Llama (async scheduling): ``step()``
   minus the model's forward, logits and sampling, with delta outputs every step as the server
   asks for them (the GC heap as it is and frozen, ``engine.heap.frozen_heap``, with the
   oldest-generation collections that ran meanwhile), and as ``LLM.generate`` adds requests
   (``stream=False``: quiet requests, no per-step outputs), heap frozen.

    python scripts/host_overhead.py --num-reqs 256
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from roofline.bench import workloads
from roofline.bench.cli import parse_range
from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import ModelRunnerOutput
from roofline.core.scheduler import Scheduler
from roofline.engine.args import EngineArgs
from roofline.engine.heap import frozen_heap
from roofline.engine.llm_engine import LLMEngine
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.block_table import BlockTables
from roofline.worker.host_batch import HostBatch, upload

CPU = torch.device("cpu")
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}


def _prompts(n: int, lens: tuple[int, int], vocab: int) -> list[list[int]]:
    return workloads.synthetic(n, lens, (1, 1), vocab).prompts


def host_pieces(num_reqs: int, lens: tuple[int, int], steps: int) -> dict[str, float]:
    """Median microseconds per decode step of each host piece, no model."""
    max_len = lens[1] + steps + 16
    config = SchedulerConfig(num_reqs, 1 << 20, max_len)
    kv = KVCacheManager(num_reqs * (-(-max_len // 16)), 16, True)
    sched = Scheduler(config, kv, 16)
    tables = BlockTables(num_reqs, -(-max_len // 16), CPU)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(_prompts(num_reqs, lens, 30000)):
        sched.add_request(Request(str(i), prompt, params, max_tokens=steps + 8))

    def sampled(out) -> ModelRunnerOutput:
        return ModelRunnerOutput({e.request.request_id: 7 for e in out.scheduled if e.samples})

    out = sched.schedule()  # the prefill step
    sched.update(out, sampled(out))
    times: dict[str, list[float]] = {"schedule": [], "build": [], "inputs": [], "update": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        batch = HostBatch.build(out, 16, tables)
        t2 = time.perf_counter()
        _, _, _, _, rows, flat, pages = upload(
            [batch.input_ids, batch.positions, batch.slots, batch.seq_lens, batch.table_rows,
             batch.table_updates.flat_index, batch.table_updates.page_ids], CPU)  # fmt: skip
        tables.apply(flat, pages)
        tables.gather(rows, batch.num_pages)
        t3 = time.perf_counter()
        sched.update(out, sampled(out))
        t4 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[key].append(dt)
    result = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    result["total"] = sum(result.values())
    return result


class _GcPauses:
    """Counts and times the oldest generation's collections while installed."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0


def engine_host(
    num_reqs: int, lens: tuple[int, int], steps: int, frozen: bool, stream: bool = True
) -> dict:
    """Mean and median host milliseconds per engine decode step (model time subtracted);
    ``stream``: a delta output per request per step (the server), else only at the end (as
    ``LLM.generate``)."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(TINY))
        engine = LLMEngine(
            EngineArgs(model=folder, load_format="dummy", device="cpu", dtype="float32",
                       max_num_seqs=num_reqs, max_num_batched_tokens=8192,
                       max_model_len=lens[1] + 2 * steps + 16, async_scheduling=True)
        )  # fmt: skip
    model, sampler = engine.runner.model, engine.runner.sampler
    device_s = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                device_s[0] += time.perf_counter() - t0

        return wrapper

    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    sampler.sample = timed(sampler.sample)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps, ignore_eos=True)
    for i, prompt in enumerate(_prompts(num_reqs, lens, TINY["vocab_size"])):
        engine.add_request(str(i), prompt, params, delta=True, stream=stream)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    host = []
    try:
        with frozen_heap() if frozen else contextlib.nullcontext():
            for _ in range(steps):
                device_s[0] = 0.0
                t0 = time.perf_counter()
                engine.step()
                host.append(time.perf_counter() - t0 - device_s[0])
    finally:
        gc.callbacks.remove(pauses)
    return {
        "host_ms_mean": 1e3 * statistics.mean(host),
        "host_ms_p50": 1e3 * statistics.median(host),
        "full_collections": pauses.count,
        "full_collection_ms": 1e3 * pauses.seconds,
        "gc_tracked_objects": len(gc.get_objects()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--input-len", type=parse_range, default=(100, 1024))
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pieces = host_pieces(args.num_reqs, args.input_len, args.steps)
    print(f"host pieces per decode step at {args.num_reqs} running (median us):")
    print("  " + ", ".join(f"{k} {v:.0f}" for k, v in pieces.items()))
    for frozen, stream in ((False, True), (True, True), (True, False)):
        r = engine_host(args.num_reqs, args.input_len, args.steps, frozen, stream)
        print(
            f"engine ({'streamed' if stream else 'offline '}), heap "
            f"{'frozen' if frozen else 'as is '}: host per step mean "
            f"{r['host_ms_mean']:.2f} ms, p50 {r['host_ms_p50']:.2f} ms; "
            f"{r['full_collections']} full collections, {r['full_collection_ms']:.0f} ms "
            f"({r['gc_tracked_objects']} tracked objects)"
        )


if __name__ == "__main__":
    main()
