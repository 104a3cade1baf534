"""The Ray executor through `LLM`: tp x pp Ray actors (gloo on CPU) against one worker.

Greedy outputs must be token-for-token those of the in-process executor in float32, for
tensor and pipeline parallelism. The executor starts (and stops) a local cluster when Ray
is not initialized, leaves a cluster the caller initialized running, and joins one named
by RAY_ADDRESS. A worker that dies or fails makes generate raise promptly (a loading
error keeps its type), and afterwards no actor process is left.

One local cluster serves the module (`ray_cluster`); the test of the executor's own
cluster runs first, before it starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pagedllm import LLM
from pagedllm.core.contracts import CachedRequestData, SchedulerOutput
from pagedllm.errors import EngineDeadError, ModelLoadError
from tests.distributed.helpers import MAX_NEW, generate, token_ids
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

ray = pytest.importorskip("ray", reason="the Ray executor needs pagedllm[ray]")

VOCAB = 256
NUM_CPUS = 4
REPO_ROOT = Path(__file__).resolve().parents[2]
# A second driver process (argv: model path, prompts as JSON, max_tokens): greedy tokens
# through the Ray executor, as JSON on its last line of output.
JOINING_DRIVER = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
          distributed_executor_backend="ray")
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]))
outs = llm.generate(prompts, params, use_tqdm=False)
llm.shutdown()
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # 4 q heads, 2 KV heads: one KV head per rank at tp=2.
    return save_tiny_model(tmp_path_factory.mktemp("llama"),
                           tiny_llama_config(num_key_value_heads=2))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, VOCAB, 3, 30, seed=3)


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    """Greedy tokens of the in-process executor (one worker)."""
    llm = _make_llm(model_path)
    try:
        return token_ids(generate(llm, prompts))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster this process starts (so executors join it); its GCS address."""
    # "local": a new instance even if RAY_ADDRESS or `ray start` names another one.
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, **kw)


def _make_ray_llm(path, tp=2, pp=1) -> LLM:
    llm = _make_llm(path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                    distributed_executor_backend="ray")
    assert len(_executor(llm).worker_locations) == tp * pp
    return llm


def _executor(llm: LLM):
    return llm.llm_engine.engine_core.executor




def _worker_pids(llm: LLM) -> list[int]:
    return [pid for _, pid in _executor(llm).worker_locations]


def _ray_daemons() -> list[psutil.Process]:
    """The Ray cluster processes this process started (ray.init's local cluster)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() in ("raylet", "gcs_server"):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def _assert_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    """The processes exit (a killed actor's process takes a moment to go)."""
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _is_running(pid)]
    assert alive == [], f"still running: {alive}"


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_resources_free(timeout_s: float = 10.0) -> None:
    """The placement group is gone: the cluster has all its CPUs again."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU") != NUM_CPUS:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_own_cluster_and_killed_actor(model_path, prompts, reference, monkeypatch):
    assert not ray.is_initialized(), "runs before the module's shared cluster starts"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    llm = _make_ray_llm(model_path)
    try:
        assert ray.is_initialized()
        daemons = _ray_daemons()
        assert daemons, "ray.init started a local cluster"
        assert token_ids(generate(llm, prompts)) == reference
        pids = _worker_pids(llm)
        os.kill(pids[1], signal.SIGKILL)  # a non-driver rank
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker 1"):
            generate(llm, prompts)
        assert time.monotonic() - start < 30
        # The executor stays dead: a new call fails at once instead of hanging.
        with pytest.raises(EngineDeadError):
            generate(llm, prompts[:1])
    finally:
        llm.shutdown()
    # The cluster the executor started is gone with it.
    assert not ray.is_initialized()
    _assert_gone(pids + [p.pid for p in daemons])


def test_greedy_parity_then_failing_step(ray_cluster, model_path, prompts, reference):
    llm = _make_ray_llm(model_path)
    try:
        pids = _worker_pids(llm)
        assert all(_is_running(pid) for pid in pids)
        assert token_ids(generate(llm, prompts)) == reference
        # A step naming a request the workers never saw: every rank raises KeyError.
        bad = SchedulerOutput(scheduled_new_reqs=[], num_scheduled_tokens={"nope": 1},
                              scheduled_cached_reqs=[CachedRequestData("nope", [], 0)],
                              total_num_scheduled_tokens=1)
        with pytest.raises(EngineDeadError, match="KeyError"):
            _executor(llm).execute_model(bad)
        _assert_gone(pids)
    finally:
        llm.shutdown()  # after a failure: a no-op that must not raise
    # The caller's cluster stays up, its resources free again.
    assert ray.is_initialized()
    _assert_resources_free()


def test_joins_cluster_at_ray_address(ray_cluster, model_path, prompts, reference):
    # Another driver process, as `RAY_ADDRESS=... pagedllm serve` would be.
    args = [str(model_path), json.dumps(prompts), str(MAX_NEW)]
    env = dict(os.environ, RAY_ADDRESS=ray_cluster,
               PYTHONPATH=os.pathsep.join(
                   p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", JOINING_DRIVER, *args], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == reference
    # The cluster outlives the driver that joined it.
    assert ray.is_initialized()
    _assert_resources_free()


def test_load_error_keeps_its_type(ray_cluster, model_path, tmp_path):
    # The engine reads only config.json; the workers fail to open the weights.
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((model_path / name).read_bytes())
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelLoadError, match="safetensors") as info:
        _make_ray_llm(tmp_path)
    assert any("raised in worker" in note for note in info.value.__notes__)
    _assert_resources_free()


@pytest.mark.parametrize("tp, pp", [(1, 2)])
def test_ray_pipeline_parallel(ray_cluster, model_path, prompts, reference, tp, pp):
    llm = _make_ray_llm(model_path, tp=tp, pp=pp)
    try:
        assert _executor(llm).max_concurrent_batches == pp
        assert token_ids(generate(llm, prompts)) == reference
        pids = _worker_pids(llm)
    finally:
        llm.shutdown()
    _assert_gone(pids)


def test_missing_ray_says_how_to_install(model_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    with pytest.raises(ImportError, match=r"pip install pagedllm\[ray\]"):
        _make_llm(model_path, tensor_parallel_size=2, distributed_executor_backend="ray")
