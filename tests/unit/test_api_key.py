"""The fleet's key on the command lines of engines and routers, and on every request of our sessions."""
from __future__ import annotations

from pathlib import Path

from rlfleet.crds.specs import EngineSpec
from rlfleet.orchestrator.run.local import LocalRun
from rlfleet.sglang.http import auth_headers, client_session, new_api_key
from rlfleet.sglang.launch import build_engine_launch, build_router_args

ENGINE = EngineSpec(model_path="/m", device="cpu")


def _value(args, flag: str) -> str:
    args = list(args)
    assert args.count(flag) == 1, args
    return args[args.index(flag) + 1]


def test_engine_gets_api_key_only_when_given():
    assert _value(build_engine_launch(ENGINE, host="h", api_key="k1").args, "--api-key") == "k1"
    assert "--api-key" not in build_engine_launch(ENGINE, host="h").args


def test_router_one_key_guards_data_and_control_plane():
    args = build_router_args(host="h", port=1, metrics_port=2, api_key="k1")
    assert _value(args, "--api-key") == "k1"  # /generate; also sent on to the workers
    assert _value(args, "--control-plane-api-keys") == "rlfleet:rlfleet:admin:k1"  # /workers
    assert "--api-key" not in build_router_args(host="h", port=1, metrics_port=2)


def test_keys_are_fresh_hex_without_the_routers_separator():
    keys = {new_api_key() for _ in range(50)}
    assert len(keys) == 50
    assert all(len(k) == 64 and ":" not in k and int(k, 16) >= 0 for k in keys)


def test_headers():
    assert auth_headers("k1") == {"Authorization": "Bearer k1"}
    assert auth_headers(None) == {} and auth_headers("") == {}


async def test_sessions_send_the_key_on_every_request():
    async with client_session("k1", headers={"X-Other": "1"}) as session:
        assert session.headers["Authorization"] == "Bearer k1" and session.headers["X-Other"] == "1"
    async with client_session(None) as session:
        assert "Authorization" not in session.headers


def test_each_local_run_has_a_key_of_its_own(tmp_path):
    from rlfleet.crds.loader import load_training_run
    from rlfleet.orchestrator.run.loop import RunOptions

    run = load_training_run(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
    first, second = (LocalRun(run, RunOptions(run_dir=tmp_path / d)) for d in ("a", "b"))
    assert first.api_key and second.api_key and first.api_key != second.api_key
