"""Tensor parallelism on the CPU with gloo: greedy tokens of TP = 2 and TP = 4 (``mp``: one
worker process per rank) and of TP = 2 on Ray (two actors) identical to TP = 1 fp32, for tiny
random Llama, Qwen2 and Qwen3 checkpoints read from safetensors folders (each rank reads its
slices), with chunked prefill (a 16-token budget), prefix caching (a shared prompt prefix) and
preemption (a KV pool of a few pages) in the same run; Qwen3 at TP = 4 has 2 KV heads for 4
ranks (replicated). A worker killed mid-generation fails the run within bounded time, and no
worker process survives."""

from __future__ import annotations

import os
import signal
import time

import pytest

from roofline import LLM, SamplingParams
from roofline.distributed.executor import WorkerError
from tests.e2e.hf_reference import tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 3,
    [20, 21, 22],
    [5, 6, 7, 8, 9, 10, 11] * 3 + [40, 41],
    [100 + i for i in range(30)],
]
ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_num_batched_tokens=16,
    num_pages=14,
    page_size=4,
    max_model_len=64,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (checkpoint folder, TP = 1 greedy tokens), built on first use."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(f"tp-{arch}")
            tiny_hf_model(arch, path, num_hidden_layers=2)
            made[arch] = path, _generate(LLM(str(path), **ENGINE))[0]
        return made[arch]

    return get


def _generate(llm: LLM) -> tuple[list[list[int]], LLM]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _check_tp(path, expected, **kwargs) -> None:
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        got, _ = _generate(llm)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got == expected
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert all(not p.is_alive() for p in llm.llm_engine.runner.procs)


@pytest.mark.parametrize(
    ("arch", "world_size"),
    # Qwen3 at 4 ranks: its 2 KV heads are replicated, on 2 ranks each
    [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 4)],
)
def test_tp_matches_tp1(tiny, arch, world_size):
    path, expected = tiny(arch)
    _check_tp(path, expected, tensor_parallel_size=world_size)


def test_ray_executor_matches_tp1(tiny):
    ray = pytest.importorskip("ray")
    path, expected = tiny("qwen2")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(str(path), **ENGINE, tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            got, _ = _generate(llm)
        finally:
            llm.llm_engine.shutdown()
        assert got == expected
    finally:
        if started:
            ray.shutdown()


def test_killed_worker_fails_the_run(tiny):
    path, _ = tiny("llama")
    llm = LLM(str(path), **ENGINE, tensor_parallel_size=2)
    executor = llm.llm_engine.runner
    steps = []

    def kill_after_a_few_steps(_sched_out) -> None:
        steps.append(time.monotonic())
        if len(steps) == 4:
            os.kill(executor.pids[1], signal.SIGKILL)

    llm.llm_engine.on_schedule = kill_after_a_few_steps
    many = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate(PROMPTS, many, use_tqdm=False)
    assert time.monotonic() - steps[3] < 30.0  # reported within bounded time
    assert all(not p.is_alive() for p in executor.procs)  # no orphans
    assert not llm.llm_engine.has_unfinished_requests()  # the requests were aborted
    with pytest.raises(WorkerError):  # and the engine stays failed
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_prompt_logprobs_match_tp1(tiny):
    """Prompt logprobs under TP = 2: every rank takes the LM head's gather, rank 0 replies;
    chunked prefill (16-token budget) spreads the 30-token prompt over steps."""
    path, _ = tiny("llama")
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, logprobs=1)
    prompts = [PROMPTS[0], PROMPTS[3]]
    got = {}
    for tp in (1, 2):
        llm = LLM(str(path), **ENGINE, tensor_parallel_size=tp)
        try:
            got[tp] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
    for one, two in zip(got[1], got[2], strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert len(one.prompt_logprobs) == len(two.prompt_logprobs) == len(one.prompt_token_ids)
        assert one.prompt_logprobs[0] is None and two.prompt_logprobs[0] is None
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            for tok in a:
                assert a[tok].rank == b[tok].rank
                assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)


def test_bad_parallel_arguments_are_refused(tiny):
    path, _ = tiny("llama")
    with pytest.raises(ValueError, match="attention heads"):
        LLM(str(path), **ENGINE, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(str(path), **ENGINE, tensor_parallel_size=2, distributed_executor_backend="mpi")


def _kill_rank1_on_step_3(engine) -> None:
    """ProcessCore setup (module level: it is pickled): SIGKILL rank 1 at the third step."""
    steps = []

    def on_schedule(_sched_out) -> None:
        steps.append(None)
        if len(steps) == 3:
            os.kill(engine.runner.pids[1], signal.SIGKILL)

    engine.on_schedule = on_schedule


def test_server_core_reports_a_dead_worker(tiny):
    """In the server's engine core process: the step fails with CoreFailed naming the rank
    (the API process then fails the requests and /health answers 503), the core exits, and its
    workers with it."""
    import psutil

    from roofline.engine.args import EngineArgs
    from roofline.engine.core import ProcessCore
    from roofline.engine.core_messages import AddRequest, CoreFailed

    path, _ = tiny("llama")
    args = EngineArgs(model=str(path), tensor_parallel_size=2, **ENGINE)
    core = ProcessCore(args, setup=_kill_rank1_on_step_3)
    workers = psutil.Process(core.pid).children(recursive=True)
    try:
        core.send(AddRequest("r", PROMPTS[3], GREEDY, 0, time.monotonic(), None))
        t0 = time.monotonic()
        while True:
            message = core.recv()
            if isinstance(message, CoreFailed):
                break
        assert time.monotonic() - t0 < 30.0
        assert isinstance(message.error, WorkerError) and "rank 1" in str(message.error)
        core.join(30.0)
        assert not core.is_alive()
        gone, alive = psutil.wait_procs(workers, timeout=30.0)
        assert not alive
    finally:
        core.stop(5.0)
        core.close()


def test_idle_server_core_notices_a_dead_worker(tiny):
    """No request running: the core checks its workers while it waits for commands, so a dead
    worker fails it (CoreFailed: the API process answers /health with 503) within seconds."""
    import psutil

    from roofline.engine.args import EngineArgs
    from roofline.engine.core import ProcessCore
    from roofline.engine.core_messages import CoreFailed

    path, _ = tiny("llama")
    core = ProcessCore(EngineArgs(model=str(path), tensor_parallel_size=2, **ENGINE))
    try:
        direct = psutil.Process(core.pid).children()  # the forkserver the workers fork from
        workers = [w for p in direct for w in p.children()]
        assert len(workers) == 2
        t0 = time.monotonic()
        os.kill(workers[-1].pid, signal.SIGKILL)
        message = core.recv()
        assert isinstance(message, CoreFailed) and "died" in str(message.error)
        assert time.monotonic() - t0 < 15.0
        core.join(30.0)
        assert not core.is_alive()
    finally:
        core.stop(5.0)
        core.close()
