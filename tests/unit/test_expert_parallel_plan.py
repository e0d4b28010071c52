"""Where an expert-parallel deployment's ranks and rendezvous are planned: every worker and
engine core knows its data-parallel rank, every worker the one rendezvous of the group (only
when the deployment runs one), and ``shoal actor worker --ep-init-method`` passes it on."""

from __future__ import annotations

from shoal.deploy.actors import actor_target
from shoal.deploy.cli import build_parser
from shoal.deploy.deployment import build_config, plan_actors

EP_INIT = "tcp://10.0.0.1:29600"


def test_every_rank_is_planned_with_the_groups_rendezvous(tmp_path):
    config = build_config(model=str(tmp_path), data_parallel_size=2, enable_expert_parallel=True)
    plans = {p.name: p.kwargs for p in plan_actors(config, ep_init_method=EP_INIT)}
    assert [(plans[w]["dp_rank"], plans[w]["ep_init_method"]) for w in ("worker-0-0", "worker-1-0")
            ] == [(0, EP_INIT), (1, EP_INIT)]  # fmt: skip
    assert [plans[e]["dp_rank"] for e in ("engine-0", "engine-1")] == [0, 1]


def test_no_group_no_rendezvous(tmp_path):
    plain = build_config(model=str(tmp_path), data_parallel_size=2)
    single = build_config(model=str(tmp_path), enable_expert_parallel=True)  # one rank: no group
    for config in (plain, single):
        workers = [p for p in plan_actors(config, ep_init_method=EP_INIT) if p.kind == "worker"]
        assert all(p.kwargs["ep_init_method"] is None for p in workers)


def test_shoal_actor_passes_the_rendezvous_on(tmp_path):
    model = str(tmp_path)
    argv = ["actor", "worker", model, "--id", "worker-1-0", "-dp", "2",
            "--enable-expert-parallel", "--ep-init-method", EP_INIT]  # fmt: skip
    ns = build_parser().parse_args(argv)
    config = build_config(model=model, data_parallel_size=2, enable_expert_parallel=True)
    _, kwargs = actor_target(ns.kind, config, ns.actor_id, ns)
    assert (kwargs["dp_rank"], kwargs["ep_init_method"]) == (1, EP_INIT)
