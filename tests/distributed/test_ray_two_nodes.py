"""Pipeline and data parallelism across Ray nodes: a Ray cluster of two nodes of one CPU each,
both on this machine (ray.cluster_utils.Cluster: a head and a second raylet, as `ray start
--head` and `ray start --address=...` would make on two machines). PP=2 puts one stage on each
node and gives the single engine's token ids; DP=2 puts one replica on each node, uses both and
gives the same token ids. Behind `extended` (~45 s: two raylets on 2 cores); skipped without
ray."""

from __future__ import annotations

import pytest

from tp_utils import engine, one_thread, token_ids

ray = pytest.importorskip("ray")

from test_ray_parallel import ENGINE, llama_with_reference  # noqa: E402 - after the skip without ray

pytestmark = [pytest.mark.timeout(300), pytest.mark.extended]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return llama_with_reference(tmp_path_factory, tokenizer_dir)


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("another Ray cluster is connected in this process")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        cluster.connect()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def actor_node(actor) -> str:
    """The node an actor runs on, from the cluster's actor table (the public state API needs
    the dashboard, which this cluster does not start)."""
    return ray._private.state.actors()[actor._actor_id.hex()]["Address"]["NodeID"]


def test_pp2_puts_a_stage_on_each_node(two_nodes, model):
    from ray.util import placement_group_table

    path, prompts, ref = model
    with one_thread(), engine(path, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        ex = llm.llm_engine.executor
        assert set(placement_group_table(ex._pg)["bundles_to_node_id"].values()) == two_nodes
        assert {actor_node(a) for a in ex._actors} == two_nodes
        assert token_ids(llm, prompts) == ref


def test_dp2_puts_a_replica_on_each_node(two_nodes, model):
    path, prompts, ref = model
    with one_thread(), engine(path, data_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        client = llm.llm_engine
        assert {actor_node(a) for a in client.transport.actors} == two_nodes
        assert token_ids(llm, prompts * 2) == ref * 2
        assert all(s.generation_tokens > 0 for s in client.get_stats().replicas)
