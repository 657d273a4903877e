"""The scaling policy and its options, without Ray: when the run grows, shrinks or cannot go on."""
import pytest

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from policies.decisions.scaling import ClusterView, ScaleDecision, ScalingPolicy, make_scaling_policy

ONE_CPU = {"CPU": 1.0}


def view(total, available, nodes=1, total_gpus=0.0, available_gpus=0.0):
    return ClusterView(total, available, total_gpus, available_gpus, nodes)


def test_a_lost_node_shrinks_at_once_to_what_fits_in_the_total():
    pol = ScalingPolicy(min_replicas=1, max_replicas=4, cpus_per_replica=1.0)
    d = pol.decide(4, view(total=2, available=0, nodes=1))  # 2 nodes of 2 CPUs, one gone
    assert (d.target, d.kind) == (2, "shrink")
    assert "SHRINK 4 -> 2" in d.reason and "2 CPU on 1 node" in d.reason and "\n" not in d.reason
    assert d.request_bundles == [ONE_CPU] * 4  # below max: ask for room for all 4 again


def test_capacity_back_grows_only_after_grow_after_polls_and_up_to_max():
    pol = ScalingPolicy(min_replicas=1, max_replicas=4, cpus_per_replica=1.0, grow_after=2)
    d = pol.decide(2, view(total=4, available=2, nodes=2))
    assert (d.target, d.kind) == (2, "hold") and "seen 1 of grow_after 2" in d.reason
    assert pol.grow_streak == 1 and d.request_bundles == [ONE_CPU] * 4
    d = pol.decide(2, view(total=4, available=2, nodes=2))
    assert (d.target, d.kind) == (4, "grow") and "GROW 2 -> 4" in d.reason
    assert pol.grow_streak == 0 and d.request_bundles == []  # at max: withdraw the request
    d = pol.decide(4, view(total=6, available=2, nodes=3))  # more room, but max is reached
    assert (d.target, d.kind, d.request_bundles) == (4, "hold", []) and "at max_replicas 4" in d.reason


def test_growth_is_capped_by_max_replicas_and_by_the_room_there_is():
    capped = ScalingPolicy(1, 3, 1.0, grow_after=1)
    assert capped.decide(2, view(total=8, available=6)).target == 3  # room for 6, max 3
    partial = ScalingPolicy(1, 6, 1.0, grow_after=1)
    d = partial.decide(2, view(total=4.5, available=2.5))  # room for 2 whole replicas
    assert (d.target, d.kind) == (4, "grow") and d.request_bundles == [ONE_CPU] * 6  # still below max 6


def test_a_flapping_node_does_not_cause_a_resize_storm():
    pol = ScalingPolicy(1, 4, 1.0, grow_after=2)
    kinds = []
    for available in (2, 0, 2, 0, 2, 0):  # the node comes and goes every poll
        kinds.append(pol.decide(2, view(total=2 + available, available=available)).kind)
    assert kinds == ["hold"] * 6 and pol.grow_streak == 0
    assert pol.decide(2, view(4, 2)).kind == "hold"
    assert pol.decide(2, view(4, 2)).kind == "grow"  # two polls in a row


def test_a_shrink_resets_the_grow_streak():
    pol = ScalingPolicy(1, 4, 1.0, grow_after=2)
    pol.decide(3, view(total=4, available=1))
    assert pol.grow_streak == 1
    assert pol.decide(3, view(total=2, available=0)).kind == "shrink"
    assert pol.grow_streak == 0
    assert pol.decide(2, view(total=4, available=2)).kind == "hold"  # counting starts over


def test_below_min_replicas_the_run_cannot_go_on():
    pol = ScalingPolicy(min_replicas=3, max_replicas=4, cpus_per_replica=1.0)
    d = pol.decide(4, view(total=2, available=0, nodes=1))
    assert (d.target, d.kind, d.request_bundles) == (2, "fail", [])
    assert d.reason.startswith("FAIL: ") and "holds 2 replicas" in d.reason and "scaling.min_replicas 3" in d.reason
    assert "\n" not in d.reason
    assert pol.decide(3, view(total=3, available=0)).kind == "hold"  # exactly min: goes on


def test_below_min_with_room_grows_at_once_and_without_room_fails():
    pol = ScalingPolicy(min_replicas=2, max_replicas=4, cpus_per_replica=1.0, grow_after=3)
    d = pol.decide(1, view(total=3, available=2))
    assert (d.target, d.kind) == (3, "grow") and "below min_replicas 2" in d.reason
    d = pol.decide(1, view(total=1, available=0))
    assert (d.target, d.kind) == (1, "fail") and "scaling.min_replicas 2" in d.reason


def test_hold_without_room_keeps_asking_while_below_max():
    pol = ScalingPolicy(1, 3, 1.0)
    d = pol.decide(2, view(total=2, available=0.5))
    assert (d.target, d.kind) == (2, "hold") and "no room for another replica" in d.reason
    assert d.request_bundles == [ONE_CPU] * 3


def test_gpus_bound_what_fits_and_are_in_the_bundles():
    pol = ScalingPolicy(1, 4, cpus_per_replica=2.0, gpus_per_replica=1.0, grow_after=1)
    assert pol.fits(16, 2) == 2 and pol.fits(3, 8) == 1 and pol.fits(16, 0) == 0
    d = pol.decide(2, view(total=16, available=12, total_gpus=2, available_gpus=0))  # CPUs, but no GPU free
    assert (d.target, d.kind) == (2, "hold") and "0 GPU free" in d.reason
    assert d.request_bundles == [{"CPU": 2.0, "GPU": 1.0}] * 4
    d = pol.decide(2, view(total=16, available=12, total_gpus=3, available_gpus=1))
    assert (d.target, d.kind) == (3, "grow")


def test_fractional_replicas_count_whole_and_survive_float_rounding():
    pol = ScalingPolicy(1, 10, cpus_per_replica=0.2)
    assert pol.fits(0.6, 0) == 3  # 0.6 / 0.2 is 2.9999999999999996 in floats
    assert pol.fits(0.59, 0) == 2 and pol.fits(0.0, 0) == 0


def test_cluster_view_from_ray_resource_dicts():
    v = ClusterView.from_resources({"CPU": 8.0, "GPU": 2.0, "memory": 1e9, "node:10.0.0.1": 1.0},
                                   {"CPU": 3.0, "object_store_memory": 1e8}, alive_nodes=2)
    assert v == ClusterView(total_cpus=8.0, available_cpus=3.0, total_gpus=2.0, available_gpus=0.0, alive_nodes=2)
    with pytest.raises(ValueError):
        ClusterView(-1, 0)


def test_bad_policy_arguments():
    for args in [(0, 2, 1.0), (3, 2, 1.0), (1, 2, 0.0), (1, 2, 1.0, -1.0)]:
        with pytest.raises(ValueError):
            ScalingPolicy(*args)
    with pytest.raises(ValueError):
        ScalingPolicy(1, 2, 1.0, grow_after=0)
    with pytest.raises(ValueError):
        ScaleDecision(2, "resize", "?")


def test_the_policy_from_the_config_does_not_grow_by_default():
    cfg = JobConfig.from_dict({"scaling": {"replicas": 3, "cpus_per_replica": 0.5}})
    pol = make_scaling_policy(cfg.scaling)
    assert (pol.min_replicas, pol.max_replicas, pol.cpus_per_replica, pol.grow_after) == (1, 3, 0.5, 2)
    d = pol.decide(3, view(total=8, available=6.5))
    assert (d.target, d.kind, d.request_bundles) == (3, "hold", [])  # max_replicas unset: no growth, no request
    grow = make_scaling_policy(JobConfig.from_dict({}, ["scaling.max_replicas=5", "scaling.grow_after=3"]).scaling)
    assert (grow.max_replicas, grow.grow_after) == (5, 3)


def test_scaling_options_defaults():
    s = JobConfig().scaling
    assert (s.max_replicas, s.lr_scaling, s.lr_warmup_steps, s.poll_s, s.grow_after) == (None, "linear", 100, 5.0, 2)
    assert s.max_or_replicas() == s.replicas == 2
    ok = JobConfig.from_dict({}, ["scaling.min_replicas=2", "scaling.replicas=2", "scaling.max_replicas=2"]).scaling
    assert (ok.min_replicas, ok.replicas, ok.max_replicas) == (2, 2, 2)


@pytest.mark.parametrize("overrides, message", [
    (["scaling.replicas=3", "scaling.max_replicas=2"],
     "config error: scaling.max_replicas (2) is less than scaling.replicas (3); need min_replicas <= replicas <= "
     "max_replicas"),
    (["scaling.replicas=2", "scaling.min_replicas=3"],
     "config error: scaling.min_replicas (3) is more than scaling.replicas (2); need min_replicas <= replicas <= "
     "max_replicas"),
    (["scaling.max_replicas=0"], "config error: scaling.max_replicas: Input should be greater than or equal to 1"),
    (["scaling.lr_scaling=sqrt"], "config error: scaling.lr_scaling: Input should be 'linear' or 'none'"),
    (["scaling.lr_warmup_steps=-1"], "config error: scaling.lr_warmup_steps:"),
    (["scaling.poll_s=0"], "config error: scaling.poll_s: Input should be greater than 0"),
    (["scaling.grow_after=0"], "config error: scaling.grow_after:"),
])
def test_bad_scaling_options_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as exc:
        JobConfig.from_dict({}, overrides)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_a_spare_reserves_no_cpu_but_its_gpu():
    """A spare in a GPU run reserves the GPU it builds its model on (without it Ray hides every
    GPU from the process and the spare dies at start); no CPU either way."""
    from orchestrator.fleet.replica_group import replica_resources

    assert replica_resources(1.0, 0.0, spare=True) == {"num_cpus": 0, "num_gpus": 0.0}
    assert replica_resources(1.0, 0.5, spare=True) == {"num_cpus": 0, "num_gpus": 0.5}
    assert replica_resources(2.0, 1.0, spare=False) == {"num_cpus": 2.0, "num_gpus": 1.0}
