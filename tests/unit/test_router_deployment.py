"""The fleet's router Deployment: created when missing, rolled when the fleet's router spec changes."""
import copy

from rlfleet.operator import builders as b
from rlfleet.operator.fleet_decide import covers, decide_router_deployment


def fleet(policy="cache_aware", image=None):
    router = {"policy": policy}
    if image:
        router["image"] = image
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": "f", "namespace": "team", "uid": "u"},
            "spec": {"replicas": 1, "engine": {"modelPath": "/m", "device": "cpu"}, "router": router}}


def as_served(deployment: dict) -> dict:
    """The Deployment as the API server returns it: our fields plus defaults we never set."""
    served = copy.deepcopy(deployment)
    served["metadata"]["uid"] = "d-uid"
    served["spec"]["strategy"] = {"type": "RollingUpdate"}
    pod = served["spec"]["template"]["spec"]
    pod["dnsPolicy"] = "ClusterFirst"
    container = pod["containers"][0]
    container.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    container["readinessProbe"].update(successThreshold=1)
    return served


def test_a_missing_router_is_created():
    action = decide_router_deployment(fleet(), None)
    assert action.verb == "create" and action.obj["metadata"]["name"] == b.router_name("f")


def test_server_defaults_are_not_drift():
    current = as_served(b.build_router_deployment(fleet()))
    assert decide_router_deployment(fleet(), current) is None


def test_a_changed_policy_or_image_rolls_the_router():
    current = as_served(b.build_router_deployment(fleet()))
    for changed in (fleet(policy="round_robin"), fleet(image="registry.example/sglang-router:v2")):
        action = decide_router_deployment(changed, current)
        assert action is not None and action.verb == "patch"
        assert action.obj["spec"]["template"] == b.build_router_deployment(changed)["spec"]["template"]
    deleting = {**current, "metadata": {**current["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert decide_router_deployment(fleet(policy="round_robin"), deleting) is None


def test_covers_compares_only_what_we_set():
    assert covers({"a": 1, "b": [{"x": 1, "y": 2}]}, {"b": [{"x": 1}]})
    assert not covers({"b": [{"x": 1}, {"x": 2}]}, {"b": [{"x": 1}]})  # a list is all or nothing
    assert not covers({"a": 1}, {"a": 2}) and not covers(None, {"a": 1}) and covers({}, {})
