"""The Ray backend (distributed_executor_backend="ray") on the CPU: the same tokens as the "mp"
backend, on a local cluster pagedllm starts itself and on a cluster of two Ray nodes simulated on
this machine (ray.cluster_utils.Cluster), where the worker rank runs on the other node.

- TP 2 on the local cluster pagedllm starts (and stops): greedy tokens and logprobs equal "mp".
- On a two-node cluster: TP 2 and PP 2 equal one rank, the worker's actor on the second node; too
  few CPUs for the ranks is a ValueError naming the numbers before any weight loads.
- A killed actor stops the engine with an error naming the rank; shutdown leaves no actor process
  and removes the placement group.
- The address file of a cluster that has died (/tmp/ray/ray_current_cluster outlives it) does not
  count as a running cluster: pagedllm starts its own instead of retrying that address for minutes.
"""

from __future__ import annotations

import pytest

import ray  # (a test dependency)

from test_tensor_parallel import (assert_a_killed_rank_stops_the_engine, assert_same_outputs,  # noqa: E402
                                  generate, random_prompts, wait_gone)
from tiny_models import build_tiny_engine_folder  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_engine_folder("llama", tmp_path_factory.mktemp("ray-llama"), num_hidden_layers=4))


def engine(folder, tp: int = 1, pp: int = 1, backend=None, **kwargs):
    from pagedllm import LLM

    return LLM(folder, device="cpu", dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
               num_gpu_blocks_override=256, distributed_executor_backend=backend, **kwargs)


def outputs(folder, prompts, params, **kwargs):
    llm = engine(folder, **kwargs)
    try:
        return generate(llm, prompts, params)
    finally:
        llm.shutdown()


def test_dead_cluster_address_file_is_not_a_running_cluster(monkeypatch):
    import socket

    import ray._private.utils as ray_utils

    from pagedllm.executor.ray_executor import _local_cluster_alive

    with socket.socket() as listener:  # a live GCS port stands in for a running cluster
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = "127.0.0.1:%d" % listener.getsockname()[1]
        monkeypatch.setattr(ray_utils, "read_ray_address", lambda temp_dir=None: live)
        assert _local_cluster_alive()
    # the same address once its listener is gone: the file of a dead cluster
    monkeypatch.setattr(ray_utils, "read_ray_address", lambda temp_dir=None: live)
    assert not _local_cluster_alive()
    monkeypatch.setattr(ray_utils, "read_ray_address", lambda temp_dir=None: None)  # no file
    assert not _local_cluster_alive()


def _params():
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def test_local_cluster_tp2_equals_mp(folder):
    """No cluster running: the executor starts a local one, runs rank 1 as an actor and stops the
    cluster at shutdown; the tokens and logprobs equal the "mp" backend's."""
    assert not ray.is_initialized()
    prompts = random_prompts(6, seed=21)
    ref = outputs(folder, prompts, _params(), tp=2, backend="mp")
    llm = engine(folder, tp=2, backend="ray")
    try:
        assert type(llm.llm_engine.executor).__name__ == "RayExecutor" and ray.is_initialized()
        assert_same_outputs(generate(llm, prompts, _params()), ref)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the cluster it started is gone


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes of 1 CPU each on this machine, connected."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_two_nodes_equal_one_rank_with_the_worker_on_the_other_node(folder, two_nodes, tp, pp, monkeypatch):
    """PP 2 also with PAGEDLLM_PP_LAYER_PARTITION=1,3 set in this process only (the actors' hosts
    do not have it): the split travels with the executor's config, so the stages agree."""
    prompts = random_prompts(6, seed=22)
    ref = outputs(folder, prompts, _params())
    if pp > 1:
        monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "1,3")
    llm = engine(folder, tp=tp, pp=pp, backend="ray")
    try:
        executor = llm.llm_engine.executor
        (info,) = executor.worker_info
        assert info["node_id"] != ray.get_runtime_context().get_node_id()  # rank 1 on the other node
        if pp > 1:
            assert (executor.driver_runner.model.start_layer, executor.driver_runner.model.end_layer) == (0, 1)
        assert_same_outputs(generate(llm, prompts, _params()), ref)
    finally:
        llm.shutdown()
    assert wait_gone([info["pid"]]) == []
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_more_ranks_than_cluster_cpus_fail_before_loading(folder, two_nodes):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x pipeline_parallel_size=2 needs 4 CPUs in the Ray "
                                         r"cluster, which has 2"):
        engine(folder, tp=2, pp=2, backend="ray")


def test_killed_actor_stops_the_engine(folder, two_nodes):
    assert_a_killed_rank_stops_the_engine(engine(folder, tp=2, backend="ray"), "Ray worker rank 1")
