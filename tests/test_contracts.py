"""Contracts: lifecycle transitions, capabilities, configuration errors, envelopes and upcasting."""

from __future__ import annotations


import pytest
from pydantic import ValidationError

from shared.configuration import load_pool_config
from shared.contracts.backends import Action, BackendType, EngineKind, engine_label, substitute, supports
from shared.contracts.commands import SleepInstance, StartInstance, command_registry
from shared.contracts.config import AliasConfig, ConfigError, ControllerConfig
from shared.contracts.control import SNAPSHOT, AliasSnapshot, PolicyState
from shared.contracts.events import (
    AliasConfigured,
    InstanceStateChanged,
    PolicyDecided,
    RoutingStateChanged,
    event_registry,
)
from shared.contracts.policies import HybridPolicyConfig
from shared.contracts.messages import FROM_THE_LOG, Contract, Envelope, Event, InvalidMessage, Registry, derived_id
from shared.contracts.states import (
    IllegalTransition,
    InstanceState as I,
    RoutingState as R,
    check_instance_transition,
    check_routing_transition,
)
from shared.settings import Settings

LLAMA, VLLM = BackendType.LLAMA_CPP, BackendType.VLLM


@pytest.mark.parametrize(
    "backend,path",
    [
        (LLAMA, [I.ABSENT, I.STARTING, I.RUNNING, I.DRAINING, I.DELETING, I.ABSENT]),
        (VLLM, [I.ABSENT, I.STARTING, I.RUNNING, I.SLEEP_1, I.SLEEP_2, I.RUNNING, I.SLEEP_1, I.SLEEP_2, I.DRAINING, I.DELETING, I.ABSENT]),
        (VLLM, [I.ABSENT, I.STARTING, I.RUNNING, I.ERROR, I.STARTING, I.RUNNING]),
    ],
)
def test_lifecycles_of_seed_000_are_legal(backend, path):
    for a, b in zip(path, path[1:]):
        check_instance_transition(backend, a, b)


@pytest.mark.parametrize(
    "backend,a,b",
    [
        (LLAMA, I.RUNNING, I.SLEEP_1),  # llama.cpp has no graded sleep
        (LLAMA, I.SLEEP_1, I.RUNNING),
        (VLLM, I.ABSENT, I.RUNNING),  # must start first
        (VLLM, I.RUNNING, I.ABSENT),  # must drain and delete
        (VLLM, I.DELETING, I.RUNNING),
        (VLLM, I.STARTING, I.SLEEP_1),
        (LLAMA, I.DRAINING, I.RUNNING),
    ],
)
def test_illegal_instance_transition_is_refused_naming_both_states(backend, a, b):
    with pytest.raises(IllegalTransition) as err:
        check_instance_transition(backend, a, b)
    assert a.value in str(err.value) and b.value in str(err.value)


def test_illegal_transition_cannot_even_be_expressed_as_an_event():
    with pytest.raises(ValidationError, match="RUNNING -> SLEEP_1"):
        InstanceStateChanged(
            instance_id="i1", alias="a", backend_type=LLAMA, engine=EngineKind.LLAMA_CPP, worker_id="w1",
            from_state=I.RUNNING, to_state=I.SLEEP_1, reason="idle",
        )


def test_history_read_back_from_the_log_is_not_judged_by_todays_rules():
    recorded = {"alias": "a", "from_state": "FAST_ONLY", "to_state": "MIXED", "reason": "x", "mix_weight": 0.2,
                "policy": "p"}  # a move an older release allowed
    with pytest.raises(ValidationError, match="FAST_ONLY -> MIXED"):
        RoutingStateChanged.model_validate(recorded)
    assert RoutingStateChanged.model_validate(recorded, context=FROM_THE_LOG).to_state is R.MIXED
    with pytest.raises(ValidationError, match="mix_weight"):  # the types are still checked
        RoutingStateChanged.model_validate({**recorded, "mix_weight": 2}, context=FROM_THE_LOG)


def test_routing_transitions():
    for a, b in [(R.COLD, R.FAST_ONLY), (R.FAST_ONLY, R.WARMING_VLLM), (R.WARMING_VLLM, R.MIXED), (R.MIXED, R.VLLM_PRIMARY),
                 (R.VLLM_PRIMARY, R.FAST_ONLY), (R.MIXED, R.DEGRADED_FAST), (R.DEGRADED_FAST, R.WARMING_VLLM)]:
        check_routing_transition(a, b)
    with pytest.raises(IllegalTransition, match="COLD -> MIXED"):
        check_routing_transition(R.COLD, R.MIXED)
    with pytest.raises(ValidationError, match="FAST_ONLY -> MIXED"):
        RoutingStateChanged(alias="a", from_state=R.FAST_ONLY, to_state=R.MIXED, reason="x", mix_weight=0.2, policy="p")


def test_capability_matrix():
    assert supports(VLLM, Action.SLEEP) and supports(VLLM, Action.WAKE)
    assert not supports(LLAMA, Action.SLEEP) and not supports(LLAMA, Action.WAKE)
    assert substitute(LLAMA, Action.SLEEP) == (Action.DRAIN, Action.DELETE)
    assert substitute(LLAMA, Action.WAKE) == ()
    assert engine_label(EngineKind.SIMULATOR, VLLM) == "simulated-vllm"
    assert engine_label(EngineKind.LLAMA_CPP, LLAMA) == "llama.cpp"


def test_instance_commands_require_backend_type():
    with pytest.raises(ValidationError, match="backend_type"):
        SleepInstance(instance_id="i1", alias="a", worker_id="w1", level=1)
    with pytest.raises(ValidationError, match="worker_id"):
        SleepInstance(instance_id="i1", alias="a", backend_type=VLLM, worker_id="w.1", level=1)


GOOD = """
controller:
  start_retry_s: 12
gateway:
  queue_size: 64
aliases:
  - alias: qwen3-vl-2b
    backends:
      llama.cpp: {model_name: q, model_path: /m/q.gguf, gpu_memory_gb: 6.0, min_replicas: 1, max_replicas: 4}
      vllm: {model_name: q, model_path: /m/q, gpu_memory_gb: 12.0, max_replicas: 2, max_model_len: 4096, engine: simulator}
    autoscaling_policy: {name: hybrid, alpha: 0.65}
  - alias: other
    backends:
      vllm: {model_name: o, model_path: /m/o, gpu_memory_gb: 12.0, engine: simulator}
    autoscaling_policy: heteroscale
"""


def test_pool_config_layers_defaults_file_environment_and_arguments(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(GOOD)
    config = load_pool_config(path, environ={"MODELPOOL_QUEUE_SIZE": "32", "MODELPOOL_CONTROL_TICK_S": "0.5"})
    hybrid = config.alias("qwen3-vl-2b").autoscaling_policy
    assert isinstance(hybrid, HybridPolicyConfig) and hybrid.alpha == 0.65  # the alias's own, over the default
    assert hybrid.vllm_sleep_l2_idle_s == 900  # seed 000 §11's default
    assert config.controller.start_retry_s == 12 and config.controller.tick_s == 0.5  # file, then environment
    assert config.gateway.queue_size == 32  # environment over file
    alias = config.alias("qwen3-vl-2b")
    assert alias.engine_for(VLLM) is EngineKind.SIMULATOR and alias.engine_for(LLAMA) is EngineKind.LLAMA_CPP
    overridden = load_pool_config(path, environ={"MODELPOOL_QUEUE_SIZE": "32"}, gateway={"queue_size": 8})
    assert overridden.gateway.queue_size == 8  # arguments over environment


LEGACY = """
policy:
  HYBRID_ALPHA: 0.65
  LLAMA_FLOOR_REPLICAS: 2
  START_RETRY_S: 5
aliases:
  - alias: old
    backends:
      vllm: {model_name: q, model_path: /m/q, gpu_memory_gb: 12.0, engine: simulator}
  - alias: own
    backends:
      vllm: {model_name: q, model_path: /m/q, gpu_memory_gb: 12.0, engine: simulator}
    autoscaling_policy: {name: hybrid, alpha: 0.8}
  - alias: scaled
    backends:
      vllm: {model_name: q, model_path: /m/q, gpu_memory_gb: 12.0, engine: simulator}
    autoscaling_policy: heteroscale
"""


def test_an_older_pool_files_policy_section_fills_in_each_hybrid_alias_and_the_controller(tmp_path, caplog):
    path = tmp_path / "pool.yaml"
    path.write_text(LEGACY)
    config = load_pool_config(path, environ={"HYBRID_UP_CONSECUTIVE": "3", "HYBRID_MIX_WEIGHTS": "25,100"})
    old, own = config.alias("old").autoscaling_policy, config.alias("own").autoscaling_policy
    assert (old.alpha, old.llama_floor_replicas, old.up_consecutive, old.mix_weights) == (0.65, 2, 3, (25, 100))
    assert own.alpha == 0.8 and own.llama_floor_replicas == 2  # the alias's own value over the pool-wide one
    assert config.alias("scaled").autoscaling_policy.name == "heteroscale"  # not the hybrid's: untouched
    assert config.controller.start_retry_s == 5
    assert "policy:" in caplog.text  # the operator is told where the settings belong now


@pytest.mark.parametrize(
    "text,field",
    [
        ("aliases:\n  - alias: a\n", "aliases[0].backends"),
        ("aliases:\n  - alias: a\n    backends: {}\n", "aliases[0].backends"),
        ("aliases:\n  - alias: a\n    backends:\n      tgi: {model_name: m, model_path: p, gpu_memory_gb: 1}\n", "aliases[0].backends.tgi"),
        ("aliases:\n  - alias: a\n    backends:\n      vllm: {model_name: m, gpu_memory_gb: 1}\n", "aliases[0].backends.vllm.model_path"),
        ("aliases:\n  - alias: a\n    backends:\n      vllm: {model_name: m, model_path: p, gpu_memory_gb: 1, min_replicas: 3, max_replicas: 1}\n", "aliases[0].backends.vllm"),
        ("aliases:\n  - alias: a\n    backends:\n      vllm: {model_name: m, model_path: p, gpu_memory_gb: 1}\n"
         "    router: {scorers: [{name: fastest}]}\n", "aliases[0].router.scorers[0].name"),
        ("aliases:\n  - alias: a\n    backends:\n      vllm: {model_name: m, model_path: p, gpu_memory_gb: 1}\n"
         "    router: {filters: [session-hash, session-host]}\n", "aliases[0].router"),
        ("aliases:\n  - alias: a\n    backends:\n      vllm: {model_name: m, model_path: p, gpu_memory_gb: 1}\n"
         "    autoscaling_policy: {name: hybrid, alpha: 2}\n", "aliases[0].autoscaling_policy.hybrid.alpha"),
        ("controller:\n  tick_s: 0\n", "controller.tick_s"),
        ("gateway:\n  queue_sizes: 5\n", "gateway.queue_sizes"),
        ("policy:\n  HYBRID_ALPHAA: 0.5\n", "policy.HYBRID_ALPHAA"),
    ],
)
def test_config_errors_name_the_field_and_the_file(tmp_path, text, field):
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_pool_config(path, environ={})
    assert err.value.field.startswith(field)
    assert str(path) in str(err.value)


def test_config_error_from_environment_names_it():
    with pytest.raises(ConfigError) as err:
        load_pool_config(None, environ={"MODELPOOL_CONTROL_TICK_S": "soon"})
    assert err.value.field == "controller.tick_s" and "MODELPOOL_CONTROL_TICK_S" in str(err.value)
    path_free = "aliases: []"
    assert load_pool_config(None, environ={}).aliases == [] and path_free
    with pytest.raises(ConfigError, match="MODELPOOL_NAMESPACE"):
        Settings.load({"MODELPOOL_NAMESPACE": "Bad-Name"})


def test_hybrid_defaults_are_seed_000_section_11():
    p = HybridPolicyConfig()
    assert (p.alpha, p.beta, p.up_consecutive, p.prepare_conc) == (0.7, 0.3, 2, 3)
    assert (p.down_hold_s, p.mix_weights, p.vllm_warm_timeout_s) == (180, (20, 50, 80, 100), 180)
    assert (p.llama_floor_replicas, p.llama_scale_down_cooldown_s, ControllerConfig().drain_timeout_s) == (1, 30, 120)
    assert (p.vllm_sleep_l1_idle_s, p.vllm_sleep_l2_idle_s, p.vllm_delete_idle_s) == (300, 900, 1800)


def test_envelope_correlation_and_derived_ids():
    cmd = Envelope.wrap(StartInstance(instance_id="i1", alias="a", backend_type=VLLM, worker_id="w1", engine=EngineKind.SIMULATOR,
                                      model_name="m", model_path="p", gpu_memory_gb=1))
    assert cmd.correlation_id == cmd.id and cmd.causation_id is None
    effect = Envelope.wrap(
        InstanceStateChanged(instance_id="i1", alias="a", backend_type=VLLM, engine=EngineKind.SIMULATOR, worker_id="w1",
                             from_state=I.ABSENT, to_state=I.STARTING, reason="start"),
        id=derived_id(cmd.id, "starting"), causation=cmd,
    )
    assert effect.causation_id == cmd.id and effect.correlation_id == cmd.id and effect.stream_id == "instance:i1"
    assert derived_id(cmd.id, "starting") == effect.id != derived_id(cmd.id, "running")
    assert isinstance(command_registry().decode(cmd), StartInstance)


def test_old_versions_are_upcast_on_read():
    class PingV1(Event):
        TYPE, VERSION, CATEGORY = "Ping", 1, "test"
        who: str

        def stream_key(self) -> str:
            return self.who

    class Ping(Event):  # v3: `who` renamed to `name` in v2, `count` added in v3
        TYPE, VERSION, CATEGORY = "Ping", 3, "test"
        name: str
        count: int

        def stream_key(self) -> str:
            return self.name

    registry = Registry([Ping])
    registry.upcaster("Ping", 1)(lambda p: {"name": p["who"]})
    registry.upcaster("Ping", 2)(lambda p: {**p, "count": 1})
    old = Envelope.wrap(PingV1(who="x"))
    assert old.version == 1
    decoded = registry.decode(old)
    assert isinstance(decoded, Ping) and decoded.name == "x" and decoded.count == 1

    future = old.model_copy(update={"version": 4})
    with pytest.raises(InvalidMessage, match="newer"):
        registry.decode(future)
    with pytest.raises(InvalidMessage, match="no upcaster"):
        Registry([Ping]).decode(old)


def test_fields_added_with_defaults_decode_as_they_are():
    class Ping(Event):  # v3: `count` added in v2, `tags` in v3
        TYPE, VERSION, CATEGORY = "Ping", 3, "test"
        name: str
        count: int = 1
        tags: list[str] = []

        def stream_key(self) -> str:
            return self.name

    registry = Registry([Ping])
    registry.fields_added("Ping", 1, "count")
    assert not registry.valid_as_is("Ping", 1)  # v2 -> v3 is not declared yet
    registry.fields_added("Ping", 2, "tags")
    assert registry.valid_as_is("Ping", 1) and registry.valid_as_is("Ping", 3) and not registry.valid_as_is("Ping", 4)
    assert registry.upcast("Ping", 1, {"name": "x"}) == (3, {"name": "x", "count": 1, "tags": []})
    with pytest.raises(ValueError, match="name must be fields with defaults"):
        registry.fields_added("Ping", 1, "name")
    with pytest.raises(ValueError, match="colour must be fields with defaults"):
        registry.fields_added("Ping", 1, "colour")


def test_instance_state_changes_of_every_version_read_as_the_latest():
    v1 = {"instance_id": "i1", "alias": "a", "backend_type": "vllm", "engine": "vllm", "worker_id": "w1",
          "from_state": "ABSENT", "to_state": "STARTING", "reason": "r", "endpoint": "http://h:1"}
    registry = event_registry()
    assert registry.upcast("InstanceStateChanged", 1, v1) == (
        4, {**v1, "exit_code": None, "log_tail": None, "internal_endpoint": None, "role": None})
    v2 = {**v1, "exit_code": 1, "log_tail": "boom"}
    version, latest = registry.upcast("InstanceStateChanged", 2, v2)
    assert version == 4 and InstanceStateChanged.model_validate(latest).internal_endpoint is None
    version, latest = registry.upcast("InstanceStateChanged", 3, {**v2, "internal_endpoint": "http://h:2"})
    assert version == 4 and InstanceStateChanged.model_validate(latest).role is None


def test_start_commands_and_alias_configs_of_older_versions_read_as_the_latest():
    commands, events = command_registry(), event_registry()
    v2 = {"instance_id": "i", "alias": "a", "backend_type": "vllm", "worker_id": "w1", "engine": "simulator",
          "model_name": "m", "model_path": "/m", "gpu_memory_gb": 1, "engine_args": {}}
    version, latest = commands.upcast("StartInstance", 2, v2)
    assert version == 3 and latest["role"] is None
    config = {"alias": "a", "backends": {"vllm": {"model_name": "m", "model_path": "/m", "gpu_memory_gb": 1}}}
    version, latest = events.upcast("AliasConfigured", 2, {"alias": "a", "config": config})
    assert version == 5 and AliasConfigured.model_validate(latest).config.autoscaling_policy.name == "hybrid"
    assert AliasConfigured.model_validate(latest).config.router.scorers is None  # the preset's
    assert events.valid_as_is("AliasConfigured", 1)


def test_a_decision_recorded_with_pool_wide_settings_reads_with_them_in_the_alias_and_the_controller():
    """PolicyDecided v1 carried the pool's `settings`; v2 has the hybrid's own parameters and the controller's."""
    config = AliasConfig.model_validate({"alias": "a", "backends": {"vllm": {
        "model_name": "m", "model_path": "/m", "gpu_memory_gb": 1, "engine": "simulator"}}})
    snapshot = SNAPSHOT.dump_python(AliasSnapshot(
        alias="a", version=3, config=config, controller=ControllerConfig(), routing_state=R.COLD,
        routing_since=None, mix_weight=0.0, targets={}, state=PolicyState()), mode="json")
    del snapshot["controller"]
    snapshot["config"]["autoscaling_policy"] = {"name": "hybrid", "debug": False}
    snapshot["settings"] = {"HYBRID_ALPHA": 0.6, "HYBRID_MIX_WEIGHTS": [50, 100], "START_RETRY_S": 7,
                            "LLAMA_DRAIN_TIMEOUT_S": 90}
    v1 = {"alias": "a", "policy": "hybrid", "policy_version": 3, "decided_at": "2026-11-26T10:00:00Z",
          "snapshot": snapshot, "decision": {}, "summary": ""}
    version, latest = event_registry().upcast(PolicyDecided.TYPE, 1, v1)
    assert version == PolicyDecided.VERSION and "settings" not in latest["snapshot"]
    read = SNAPSHOT.validate_python(latest["snapshot"])
    assert (read.config.autoscaling_policy.alpha, read.config.autoscaling_policy.mix_weights) == (0.6, (50, 100))
    assert (read.controller.start_retry_s, read.controller.drain_timeout_s) == (7, 90)


def test_every_contract_type_is_unique_and_registered():
    events, commands = event_registry(), command_registry()
    assert events.known("RoutingStateChanged") and commands.known("StartInstance")
    with pytest.raises(ValueError, match="two contracts"):
        class Other(Contract):
            TYPE = "StartInstance"
        Registry([StartInstance, Other])
