"""Speculative decoding on the GPU, measured against the planner's prediction. One process:

0. Parity: tiny fp32 models on the GPU with decode and verification CUDA graphs, greedy tokens
   identical with and without speculation (n-gram, the target as its own draft where every
   proposal must be accepted; full run: a different draft).
1. Llama-3.1-8B config (random weights with a planted successor, ``oracle.plant_successor``:
   every kernel and byte read as before, the greedy next token a fixed function of the current
   one with a margin no bf16 rounding flips), k = 4:
   a. the start-up calibration: plain decode graph + head and verification grid + head per
      bucket at contexts 128 and 1024, the bucket each batch replays (the cheapest at least its
      size), and cuBLAS alone at the grid's row counts (why some buckets cost more);
   b. the oracle proposer at alpha 0.5 / 0.9 (full: 0.7 too), re-synchronised to each request's
      actual last token: plain vs forced vs adaptive speculation at batch 1, 8, 32, 128, each
      with the acceptance it achieved, its decode-only speedup (the prefill's time, measured
      once per batch, subtracted), the planner's prediction (``planner.specdec.roofline_speedup``
      with a step model fitted on the start-up graph timings, at the run's mean context, plus
      the host prior of a synchronous step: nothing from the run itself), where a forced
      speculative step's time goes (device at the run's context from the calibration; host:
      proposing, scheduling, launching, folding, emitting), and the adaptive switch's share of
      speculative steps, mode changes and shadow proposals (its first decisions printed when
      it misses ``max(0.99, 0.9 x forced)``). The switch starts cold each run with the
      n-gram / draft prior (0.6). Every run's tokens are checked against the successor chain.
2. Regression: Llama-3.1-8B batch-1 plain decode in an engine without speculation (>= 169).
3. (full) Qwen3-8B config (planted) with a Qwen3-0.6B-config draft model (its k draft steps
   really run; the proposals it hands over are the oracle's, so the acceptance is controlled):
   the draft cost ratio and the speedup against ``tokens / (t_verify / t_plain + k x ratio)``.
4. (full) The n-gram proposer's host time per step at batch 64 (1k-token histories).

    PYTHONPATH=. python scripts/gpu_specdec.py --quick   # parity, b 1-128 x alpha 0.5 / 0.9 (~90 s)
    PYTHONPATH=. python scripts/gpu_specdec.py           # everything (~3-4 minutes, H100)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import random
import time
import traceback

import numpy as np
import torch

from roofline import LLM, SamplingParams
from roofline.bench.ceilings import measure, time_fn
from roofline.planner.specdec import expected_tokens_per_step as tokens_at
from roofline.planner.specdec import roofline_speedup
from roofline.planner.step_model import fit_floored
from roofline.request import Request
from roofline.spec_decode.adaptive import ASSUMED_ACCEPTANCE
from roofline.spec_decode.ngram import NgramProposer
from roofline.spec_decode.oracle import OracleProposer, plant_successor
from roofline.spec_decode.step_costs import SPEC_HOST_PER_REQUEST_S, SPEC_HOST_S

K = 4
ALPHAS = (0.5, 0.7, 0.9)
PROMPT_LEN = 64


def prompts_for(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(PROMPT_LEN)] for _ in range(batch)]


_RUNS = itertools.count()


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Generate greedily (the engine's own step loop); wall time, steps, the speculative
    counters of this run, and the steady rate: tokens per second from the step after the last
    prefill to the first request's finish (every request running: what a server whose batch
    stays full sees, and what the planner predicts; the whole-run rate also waits for the
    unluckiest request of the batch)."""
    engine = llm.llm_engine
    stats = engine.spec.stats if engine.spec is not None else None
    r0 = stats.num_rejections if stats is not None else 0
    p0 = (stats.propose_s, stats.num_propose_calls) if stats is not None else (0.0, 0)
    timing0 = dataclasses.replace(engine.step_timing)
    s0 = engine.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run = next(_RUNS)
    ids = [f"t{run}-{i}" for i in range(len(prompts))]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params, stream=False)
    reqs = [engine._groups[rid].seqs[0] for rid in ids]
    sched = engine.scheduler
    start = end = None  # (seconds, tokens) at the steady window's ends
    while engine.has_unfinished_requests():
        engine.step()
        if end is not None:
            continue
        if start is None:
            if not sched.num_waiting and all(r.output_token_ids for r in reqs):
                start = (time.perf_counter(), sum(len(r.output_token_ids) for r in reqs))
        elif sched.num_running < len(reqs):
            end = (time.perf_counter(), sum(len(r.output_token_ids) for r in reqs))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steady = float("nan")
    if start is not None and end is not None and end[0] > start[0]:
        steady = (end[1] - start[1]) / (end[0] - start[0])
    s1 = engine.get_stats()
    steps = engine.step_timing.since(timing0).steps
    drafts = s1.spec_decode_num_drafts_total - s0.spec_decode_num_drafts_total
    proposed = s1.spec_decode_num_draft_tokens_total - s0.spec_decode_num_draft_tokens_total
    accepted = s1.spec_decode_num_accepted_tokens_total - s0.spec_decode_num_accepted_tokens_total
    mean_len = (accepted + drafts) / drafts if drafts else 1.0
    rejections = (stats.num_rejections - r0) if stats is not None else 0
    propose = (stats.propose_s - p0[0], stats.num_propose_calls - p0[1]) if stats else (0.0, 0)
    return {
        "tokens": [list(r.output_token_ids) for r in reqs],
        "wall_s": wall,
        "steps": steps,
        "step_s": wall / max(steps, 1),
        "tok_s": len(prompts) * max_tokens / wall,
        "steady_tok_s": steady,
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_len": mean_len,
        "propose_s": propose[0],
        "propose_calls": propose[1],
        # the per-token alpha of the i.i.d. model: accepted / (accepted + first rejections)
        # (accepted / proposed is lower: the proposals after a rejection are never tried)
        "alpha": accepted / (accepted + rejections) if accepted + rejections else 0.0,
    }


def speedup_at(alpha: float, k: int, cost_ratio: float) -> float:
    """tokens(alpha, k) / cost ratio, as ``roofline plan specdec`` computes it."""
    return tokens_at(min(alpha, 1.0), k) / cost_ratio


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def spec_of(llm: LLM):
    spec = llm.llm_engine.spec
    assert spec is not None
    return spec


def forced(spec, on: bool) -> None:
    """Speculation always on (the switch bypassed) or always off."""
    spec.max_batch_size = 10**6 if on else 0
    spec.switch = None if on else spec.switch


def adaptive(spec, switch, max_batch: int) -> None:
    """The engine's own choice: the adaptive switch, started cold."""
    spec.max_batch_size, spec.switch = max_batch, switch
    if switch is not None:
        switch.reset()


def chain_ok(prompts, tokens, successor) -> float:
    """Fraction of requests whose every token is the planted successor of the one before."""
    ok = 0
    for prompt, out in zip(prompts, tokens):
        last, good = prompt[-1], True
        for t in out:
            last = int(successor[last])
            good = good and t == last
        ok += good
    return ok / len(prompts)


def plant(llm: LLM):
    """Plant the successor in the target and hand it to the oracle (if the proposer is one)."""
    engine = llm.llm_engine
    successor = plant_successor(engine.runner.model, seed=0)
    proposer = engine.spec.proposer if engine.spec is not None else None
    if isinstance(proposer, OracleProposer):
        proposer.set_successor(successor)
    return successor


class HostClock:
    """Wall seconds spent in the engine's step phases and, inside the runner's launch, in its
    parts (methods and module functions wrapped, restored by ``close``)."""

    PHASES = ("propose", "schedule", "launch", "fold", "emit")
    PARTS = ("build", "grid", "stage", "replay", "logits", "verify")

    def __init__(self, engine) -> None:
        import roofline.worker.model_runner as mr

        self.acc = dict.fromkeys(self.PHASES + self.PARTS, 0.0)
        self._restore: list[tuple[object, str, object]] = []
        runner = engine.runner
        targets = [(engine.spec, "propose"), (engine.scheduler, "schedule"),
                   (runner, "launch"), (engine, "_fold"), (engine, "_emit"),
                   (mr, "grid_layout"), (mr, "launch_verification"),
                   (runner.model, "compute_logits")]  # fmt: skip
        names = ["propose", "schedule", "launch", "fold", "emit", "grid", "verify", "logits"]
        if runner.verify_graphs is not None:
            targets += [(runner.verify_graphs, "stage"), (runner.verify_graphs, "replay")]
            names += ["stage", "replay"]
        for (obj, attr), name in zip(targets, names):
            self._patch(obj, attr, self._wrap(getattr(obj, attr), name))
        self._patch(mr.HostBatch, "build", staticmethod(self._wrap(mr.HostBatch.build, "build")))

    def _patch(self, obj, attr: str, value) -> None:
        own = vars(obj).get(attr, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        self._restore.append((obj, attr, own))
        setattr(obj, attr, value)

    def _wrap(self, fn, name):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t0

        return timed_call

    def close(self) -> None:
        for obj, attr, own in reversed(self._restore):
            if own is _MISSING:
                delattr(obj, attr)  # the class's method again
            else:
                setattr(obj, attr, own)


_MISSING = object()


def section_gemm(rows: list[str], summary: dict) -> None:
    """cuBLAS (F.linear, bf16) at the verification grid's row counts, Llama-3.1-8B shapes."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip
    dev = torch.device("cuda")
    out = {}
    ms_rows = (320, 384, 400, 448, 480, 512, 560, 576, 640)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        line = []
        for m in ms_rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t = time_fn(lambda x=x, w=w: torch.nn.functional.linear(x, w), dev, 10, 3)
            out[f"{name}_m{m}"] = t
            line.append(f"{m}:{t * 1e6:.0f}")
        rows.append(f"cuBLAS {name:8} [{n}x{k}] us by rows " + " ".join(line))
        print(rows[-1], flush=True)
        del w
    summary["gemm_us"] = {key: v * 1e6 for key, v in out.items()}
    free()


def section_llama(ceil, summary: dict, rows: list[str], quick: bool) -> None:
    max_seqs = 128
    llm = LLM(
        "llama-3.1-8b",
        load_format="dummy",
        device="cuda",
        max_model_len=2048,
        max_num_seqs=max_seqs,
        kv_cache_memory_bytes=16 << 30,
        speculative_config={"method": "oracle", "num_speculative_tokens": K},
    )
    spec = spec_of(llm)
    switch = spec.switch
    cal = spec.calibration
    engine = llm.llm_engine
    cfg = engine.model_config
    hw = ceil.as_gpu_spec()
    timer = None
    if cal is not None:
        by_bucket: dict[int, list[str]] = {}
        for b, ctx, plain, ph, grid, gh in cal.table:
            by_bucket.setdefault(b, []).append(
                f"ctx {ctx}: plain {plain * 1e3:5.2f}+{ph * 1e3:4.2f} grid {grid * 1e3:5.2f}+"
                f"{gh * 1e3:4.2f} ms ({(grid + gh) / (plain + ph):.2f}x)"
            )
        for b, parts in by_bucket.items():
            rows.append(f"llama8b graphs b={b:<3} ({b * (K + 1):3} rows) " + " | ".join(parts)
                        + f" | replays bucket {cal.replays[b]}")  # fmt: skip
            print(rows[-1], flush=True)
        summary["calibration"] = {"table": cal.table, "replays": cal.replays}
        try:
            timer = fit_floored(cal.points(K), cfg, hw)
            rows.append(f"step model on the graph timings: mean error {timer.mean_rel_error:.1%}"
                        f", max {timer.max_rel_error:.1%}, terms " + ", ".join(
                            f"{n}={v:.3g}" for n, v in timer.terms().items() if v))  # fmt: skip
            print(rows[-1], flush=True)
        except Exception:
            traceback.print_exc()
            timer = None
    oracle: OracleProposer = spec.proposer  # type: ignore[assignment]
    successor = plant(llm)
    alphas = (0.5, 0.9) if quick else ALPHAS
    cases = ((1, 128), (8, 128), (32, 128), (128, 128)) if quick else (
        (1, 256), (8, 256), (32, 192), (128, 192)
    )  # fmt: skip
    for batch, max_tokens in cases:
        prompts = prompts_for(batch, batch)
        forced(spec, True)
        timed(llm, prompts, 8)  # warm: this batch's prefill and verification shapes
        forced(spec, False)
        timed(llm, prompts, 8)
        first = timed(llm, prompts, 1)  # subtracted: the decode-only speedups and step costs
        prefill, prefill_steps = first["wall_s"], first["steps"]
        base = timed(llm, prompts, max_tokens)
        base_decode = base["wall_s"] - prefill
        ctx = PROMPT_LEN + max_tokens // 2  # the decode steps' mean context
        res = {"batch": batch, "base_tok_s": base["tok_s"], "base_step_ms": base["step_s"] * 1e3,
               "prefill_s": prefill, "context": ctx,
               "base_chain_ok": chain_ok(prompts, base["tokens"], successor)}  # fmt: skip
        t_plain = base_decode / max(base["steps"] - prefill_steps, 1)
        rows.append(
            f"llama8b b={batch:<3} plain {base['tok_s']:.0f} tok/s (steady "
            f"{base['steady_tok_s']:.0f}), {t_plain * 1e3:.2f} ms/decode step, prefill "
            f"{prefill:.2f} s, planted chain ok {res['base_chain_ok']:.2f}"
        )
        print(rows[-1], flush=True)
        host_prior = SPEC_HOST_S + SPEC_HOST_PER_REQUEST_S * batch
        for alpha in alphas:
            oracle.alpha = alpha
            forced(spec, True)
            clock = HostClock(engine)
            timing0 = dataclasses.replace(engine.step_timing)
            run = timed(llm, prompts, max_tokens)
            waited = engine.step_timing.since(timing0).wait_s
            clock.close()
            if switch is not None:  # it must learn alpha: the n-gram / draft prior, not alpha
                switch.alpha_prior = ASSUMED_ACCEPTANCE
            adaptive(spec, switch, max_seqs)
            if switch is not None:
                switch.trace = []
            auto = timed(llm, prompts, max_tokens)
            speedup = base["wall_s"] / run["wall_s"]
            speedup_auto = base["wall_s"] / auto["wall_s"]
            dec = base_decode / max(run["wall_s"] - prefill, 1e-9)
            dec_auto = base_decode / max(auto["wall_s"] - prefill, 1e-9)
            steady = run["steady_tok_s"] / base["steady_tok_s"]
            steady_auto = auto["steady_tok_s"] / base["steady_tok_s"]
            eff = run["alpha"]
            spec_steps = max(run["steps"] - prefill_steps, 1)
            t_spec = (run["wall_s"] - prefill) / spec_steps
            pred_meas = speedup_at(eff, K, t_spec / t_plain)
            pred = pred_roofline = float("nan")
            device_ms = float("nan")
            if timer is not None:
                pred = roofline_speedup(cfg, None, hw, eff, K, batch, ctx, timer=timer,
                                        spec_host_s=host_prior).speedup  # fmt: skip
            if cal is not None and switch is not None:
                device_ms = cal.spec.seconds(switch.bucket(batch), ctx) * 1e3
            pred_roofline = roofline_speedup(cfg, None, hw, eff, K, batch, ctx).speedup
            parts = {n: v / spec_steps * 1e3 for n, v in clock.acc.items()}
            res.setdefault("host_parts_ms", {})[alpha] = dict(parts)
            parts["fold"] -= waited / spec_steps * 1e3  # the wait is the device's
            parts["wait"] = waited / spec_steps * 1e3
            on_share = switch.num_on_steps / max(switch.step, 1) if switch else float("nan")
            flips = switch.num_switches if switch else -1
            shadowed = switch.num_shadowed if switch else -1
            ok = min(chain_ok(prompts, run["tokens"], successor),
                     chain_ok(prompts, auto["tokens"], successor))  # fmt: skip
            want = max(0.99, 0.9 * dec)
            res[f"a{alpha}"] = {
                "speedup_forced": speedup,
                "speedup_adaptive": speedup_auto,
                "decode_speedup_forced": dec,
                "decode_speedup_adaptive": dec_auto,
                "steady_speedup_forced": steady,
                "steady_speedup_adaptive": steady_auto,
                "tok_s": run["tok_s"],
                "tok_s_adaptive": auto["tok_s"],
                "effective_acceptance": eff,
                "effective_acceptance_adaptive": auto["alpha"],
                "mean_len": run["mean_len"],
                "pred_planner": pred,
                "pred_planner_measured_costs": pred_meas,
                "pred_roofline": pred_roofline,
                "spec_step_ms": t_spec * 1e3,
                "plain_step_ms": t_plain * 1e3,
                "spec_device_ms_model": device_ms,
                "spec_host_parts_ms": parts,
                "adaptive_spec_step_share": on_share,
                "adaptive_mode_changes": flips,
                "adaptive_shadowed": shadowed,
                "chain_ok": ok,
            }
            rows.append(
                f"llama8b b={batch:<3} a={alpha} (eff {eff:.2f}/{auto['alpha']:.2f}) forced "
                f"{dec:4.2f}x steady {steady:4.2f}x (len {run['mean_len']:.2f}) | planner "
                f"{pred:4.2f}x ({(steady / pred - 1) * 100:+.0f}% steady) roofline "
                f"{pred_roofline:4.2f}x | adaptive {dec_auto:4.2f}x steady {steady_auto:4.2f}x "
                f"(want >= {want:.2f}; spec {on_share:.0%} of steps, {flips} changes, {shadowed} "
                f"shadowed) chain {ok:.2f}"
            )
            print(rows[-1], flush=True)
            launch = ", ".join(f"{n} {parts.pop(n):.2f}" for n in HostClock.PARTS)
            rows.append(
                f"   spec step {t_spec * 1e3:.2f} ms = {t_spec / t_plain:.2f} plain (device "
                f"model {device_ms:.2f} ms at ctx {ctx}, host prior {host_prior * 1e3:.2f}); "
                + ", ".join(f"{n} {v:.2f}" for n, v in parts.items())
                + f"; in launch: {launch}"
            )
            print(rows[-1], flush=True)
            if switch is not None and dec_auto < want:  # why: the switch's first decisions
                res[f"a{alpha}"]["trace"] = switch.trace[:24]
                for step, b, on, gain, rho, pooled in switch.trace[:12]:
                    print(f"   step {step} b={b} on={on} gain {gain:.2f} rho {rho:.2f} "
                          f"pooled alpha {pooled:.2f}")  # fmt: skip
                print("   host residuals:", {m: h.measured for m, h in switch.host.items()})
            if switch is not None:
                switch.trace = None
        summary[f"llama8b_b{batch}"] = res
    del llm, engine, spec, oracle, switch
    free()


def section_regression(summary: dict, rows: list[str]) -> None:
    """Llama-3.1-8B batch-1 plain decode, no speculation configured (goal >= 169 tok/s)."""
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", max_model_len=2048)
    prompts = prompts_for(1, 3)
    timed(llm, prompts, 16)
    first = timed(llm, prompts, 1)
    run = timed(llm, prompts, 256)
    tok_s = 255 / max(run["wall_s"] - first["wall_s"], 1e-9)
    summary["llama8b_b1_plain_no_spec_tok_s"] = tok_s
    rows.append(f"regression: llama8b b=1 plain decode, no speculation: {tok_s:.1f} tok/s "
                f"(>= 169: {'OK' if tok_s >= 169 else 'LOW'})")  # fmt: skip
    print(rows[-1], flush=True)
    del llm
    free()


class _OracleDraft:
    """Runs the real draft model for its cost, hands over the oracle's proposals."""

    needs_hidden_states = False

    def __init__(self, draft, oracle: OracleProposer) -> None:
        self.draft, self.oracle = draft, oracle

    def propose(self, requests, max_lens, hidden_states=None):
        self.draft.propose(requests, max_lens)
        return self.oracle.propose(requests, max_lens)

    def remove(self, request_ids) -> None:
        ids = list(request_ids)
        self.draft.remove(ids)
        self.oracle.remove(ids)


def section_qwen_draft(ceil, summary: dict, rows: list[str]) -> None:
    llm = LLM(
        "qwen3-8b",
        load_format="dummy",
        device="cuda",
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_memory_bytes=8 << 30,
        speculative_config={
            "method": "draft_model",
            "model": "qwen3-0.6b",
            "num_speculative_tokens": K,
            "disable_by_batch_size": 8,
        },
    )
    spec = spec_of(llm)
    engine = llm.llm_engine
    oracle = OracleProposer(K, 0.7, engine.model_config.vocab_size, 0)
    draft = spec.proposer
    spec.proposer = _OracleDraft(draft, oracle)
    successor = plant(llm)
    oracle.set_successor(successor)
    prompts = prompts_for(1, 7)
    forced(spec, False)
    timed(llm, prompts, 8)
    base = timed(llm, prompts, 192)
    for alpha in ALPHAS:
        oracle.alpha = alpha
        forced(spec, True)
        run = timed(llm, prompts, 192)
        draft_step = run["propose_s"] / max(run["propose_calls"], 1) / K
        ratio = draft_step / base["step_s"]
        verify_ratio = (run["step_s"] - K * draft_step) / base["step_s"]
        eff = run["alpha"]
        pred = speedup_at(eff, K, verify_ratio + K * ratio)
        speedup = base["wall_s"] / run["wall_s"]
        summary[f"qwen3_8b_draft_a{alpha}"] = {
            "speedup": speedup,
            "pred": pred,
            "draft_cost_ratio": ratio,
            "verify_cost_ratio": verify_ratio,
            "effective_acceptance": eff,
            "chain_ok": chain_ok(prompts, run["tokens"], successor),
            "base_tok_s": base["tok_s"],
            "tok_s": run["tok_s"],
        }
        rows.append(
            f"qwen3-8b+0.6b a={alpha} (eff {eff:.2f}) "
            f"speedup {speedup:5.2f}x pred {pred:5.2f}x "
            f"({(speedup / pred - 1) * 100:+.0f}%) draft/target step {ratio:.3f} "
            f"verify/plain {verify_ratio:.2f} {run['tok_s']:.0f} vs {base['tok_s']:.0f} tok/s"
        )
        print(rows[-1], flush=True)
    del llm, engine, spec, draft
    free()


def section_parity(summary: dict, rows: list[str], quick: bool) -> None:
    """Greedy tokens identical with and without speculation: tiny fp32 models on the GPU with
    decode and verification graphs (n-gram; a different draft; the target as its own draft,
    where everything must be accepted)."""
    import tempfile

    from tests.e2e.hf_reference import tiny_hf_model

    tmp = tempfile.mkdtemp()
    target, other = os.path.join(tmp, "target"), os.path.join(tmp, "draft")
    tiny_hf_model("llama", target, seed=0)
    tiny_hf_model("llama", other, seed=1, num_hidden_layers=1)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (1, 9, 30, 70)]
    prompts.append([11, 12, 13, 14, 15] * 8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20, max_num_seqs=16)
    ref_llm = LLM(target, **kw)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    del ref_llm
    cases = [
        ("ngram k=3", {"method": "ngram", "num_speculative_tokens": 3}),
        ("draft=self k=4", {"method": "draft_model", "model": target, "num_speculative_tokens": 4}),
    ]
    if not quick:
        cases.append(
            (
                "draft=other k=4",
                {"method": "draft_model", "model": other, "num_speculative_tokens": 4},
            )
        )
    for name, cfg in cases:
        cfg["disable_by_batch_size"] = 16
        llm = LLM(target, speculative_config=cfg, **kw)
        forced(spec_of(llm), True)  # a tiny model is host-bound: the switch would turn it off
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        st = llm.llm_engine.get_stats()
        acc = st.spec_decode_num_accepted_tokens_total / max(
            st.spec_decode_num_draft_tokens_total, 1
        )
        graphs = llm.llm_engine.runner.verify_graphs is not None
        same = sum(a == b for a, b in zip(got, ref))
        ok = same == len(ref) and (name != "draft=self k=4" or acc == 1.0) and graphs
        summary[f"parity_{name}"] = {"identical": same, "of": len(ref), "acceptance": acc,
                                     "verify_graphs": graphs, "ok": ok}  # fmt: skip
        rows.append(f"parity {name:15} identical {same}/{len(ref)} acceptance {acc:.2f} "
                    f"verify graphs {graphs} -> {'OK' if ok else 'FAIL'}")  # fmt: skip
        print(rows[-1], flush=True)
        del llm
        free()


def section_ngram(summary: dict, rows: list[str]) -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(K, 1, 4)
    requests = []
    for i in range(64):
        base = rng.integers(0, 32000, 256).tolist()
        requests.append(Request(f"r{i}", base * 4, SamplingParams()))  # repeats: matches exist
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        proposer.propose(requests, [K] * 64)
        times.append(time.perf_counter() - t0)
        for r in requests:
            r.output_token_ids.append(int(rng.integers(0, 32000)))
    ms = float(np.median(times[5:])) * 1e3
    summary["ngram_b64_ms_per_step"] = ms
    rows.append(f"n-gram proposer, batch 64, ~1k-token histories: {ms:.2f} ms per step (host)")
    print(rows[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--quick", action="store_true", help="parity, b 1-128 at alpha 0.5 / 0.9 (~90 s)"
    )
    args = ap.parse_args()
    t_start = time.perf_counter()
    summary: dict = {}
    rows: list[str] = []
    dev = torch.device("cuda")
    ceil = measure(dev, torch.bfloat16)
    summary["ceilings"] = dataclasses.asdict(ceil)
    print(f"ceilings: {ceil}", flush=True)
    sections = [
        ("parity", lambda: section_parity(summary, rows, args.quick)),
        ("gemm", lambda: section_gemm(rows, summary)),
        ("llama", lambda: section_llama(ceil, summary, rows, args.quick)),
        ("regression", lambda: section_regression(summary, rows)),
    ]
    if not args.quick:
        sections.append(("qwen_draft", lambda: section_qwen_draft(ceil, summary, rows)))
        sections.append(("ngram", lambda: section_ngram(summary, rows)))
    for name, fn in sections:
        try:
            fn()
        except Exception:
            traceback.print_exc()
            rows.append(f"{name}: FAILED (see the traceback above)")
            free()
    summary["wall_s"] = time.perf_counter() - t_start
    summary["rows"] = rows  # the printed table, in case stdout does not come back
    with open(os.path.join(args.out, "gpu_specdec.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"\n=== speculative decoding summary ({summary['wall_s']:.0f} s) ===")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
