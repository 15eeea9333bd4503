"""A worker starts only what an alias's recorded configuration says: a `StartInstance` published by anyone who
reaches the bus cannot run another model, engine or flag (`trust-remote-code` on a repository of its choosing);
and a pool file cannot give an engine the worker's own flags or ones that load code."""

from __future__ import annotations

import pytest

from services.worker.allowed import start_refusal
from services.worker.engines import EngineLauncher, EngineOptions
from services.worker.service import Worker
from shared.configuration import pool_config
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import StartInstance
from shared.contracts.config import AliasConfig, BackendConfig, ConfigError
from shared.contracts.events import AliasConfigured
from shared.contracts.messages import Envelope

ALIAS = "chat"
CONFIG = AliasConfig(alias=ALIAS, backends={
    BackendType.VLLM: BackendConfig(model_name="m", model_path="/models/m", gpu_memory_gb=12, engine=EngineKind.SIMULATOR,
                                    engine_args={"startup-s": 0}),
    BackendType.LLAMA_CPP: BackendConfig(model_name="m", model_path="default", gpu_memory_gb=0)})


def start(**changes) -> StartInstance:
    fields = dict(instance_id="chat/v-1", alias=ALIAS, backend_type=BackendType.VLLM, worker_id="w1",
                  engine=EngineKind.SIMULATOR, model_name="m", model_path="/models/m", gpu_memory_gb=12,
                  engine_args={"startup-s": 0})
    return StartInstance(**{**fields, **changes})


def test_a_start_is_allowed_only_as_its_alias_is_configured() -> None:
    assert start_refusal(start(), CONFIG) is None
    assert start_refusal(start(backend_type=BackendType.LLAMA_CPP, engine=EngineKind.LLAMA_CPP, model_path="default",
                               gpu_memory_gb=0, engine_args={}), CONFIG) is None
    refusals = {
        "unconfigured alias": (start(alias="other"), None, "not configured"),
        "other model file": (start(model_path="/tmp/evil"), CONFIG, "model_path"),
        "other model name": (start(model_name="n"), CONFIG, "model_name"),
        "other engine": (start(engine=EngineKind.VLLM), CONFIG, "engine"),
        "remote code": (start(engine_args={"startup-s": 0, "trust-remote-code": True}), CONFIG, "engine_args"),
        "another address": (start(engine_args={"startup-s": 0, "host": "0.0.0.0"}), CONFIG, "engine_args"),
        "no such backend": (start(backend_type=BackendType.LLAMA_CPP, engine=EngineKind.LLAMA_CPP),
                            AliasConfig(alias=ALIAS, backends={BackendType.VLLM: CONFIG.backends[BackendType.VLLM]}),
                            "no llama.cpp backend"),
    }
    for name, (cmd, config, said) in refusals.items():
        refusal = start_refusal(cmd, config)
        assert refusal is not None and said in refusal, (name, refusal)
    # A recorded configuration with a flag outside the allow-list (an older log's) still starts nothing with it.
    loose = AliasConfig(alias=ALIAS, backends={BackendType.VLLM: CONFIG.backends[BackendType.VLLM].model_copy(
        update={"engine_args": {"middleware": "evil.module"}})})
    assert "middleware" in start_refusal(start(engine_args={"middleware": "evil.module"}), loose)


@pytest.mark.parametrize("engine,flag", [("vllm", "host"), ("vllm", "middleware"), ("vllm", "served-model-name"),
                                         ("llama-server", "port"), ("llama-server", "api-key"),
                                         ("llama.cpp", "model"), ("simulator", "internal-port")])
def test_a_pool_file_naming_a_flag_outside_its_engines_allow_list_is_refused_by_field(engine, flag) -> None:
    backend = "llama.cpp" if engine in ("llama.cpp", "llama-server") else "vllm"
    data = {"aliases": [{"alias": ALIAS, "backends": {backend: {
        "model_name": "m", "model_path": "/m", "gpu_memory_gb": 1, "engine": engine, "engine_args": {flag: "x"}}}}]}
    with pytest.raises(ConfigError, match=rf"backends\.{backend}\.engine_args\.{flag}: not a flag"):
        pool_config(data, source="pool.yaml", environ={})
    allowed = {"vllm": "max-num-seqs", "llama-server": "parallel", "llama.cpp": "n-seq-max", "simulator": "startup-s"}
    data["aliases"][0]["backends"][backend]["engine_args"] = {allowed[engine]: 4, "trust-remote-code": True} \
        if engine == "vllm" else {allowed[engine]: 4}
    pool_config(data, source="pool.yaml", environ={})  # the alias says so: trust-remote-code passes for vLLM


def test_the_allow_lists_name_only_flags_the_engines_have() -> None:
    from services.engines.llamacpp.cli import build_parser as llamacpp_parser
    from services.engines.simulated.cli import build_parser as sim_parser
    from shared.contracts.engine_flags import LLAMA_CPP_FLAGS, SIMULATOR_FLAGS

    for parser, allowed in ((sim_parser(), SIMULATOR_FLAGS), (llamacpp_parser(), LLAMA_CPP_FLAGS)):
        options = {o[2:] for action in parser._actions for o in action.option_strings if o.startswith("--")}
        assert allowed <= options, allowed - options
        assert not allowed & {"host", "port", "model", "internal-host", "internal-port", "log-level"}


async def test_a_worker_records_a_refused_start_and_runs_nothing(store, telemetry, tmp_path) -> None:
    worker = Worker(worker_id="w1", store=store, telemetry=telemetry, gpu_memory_gb=80, slots=4,
                    launcher=EngineLauncher(EngineOptions(log_dir=tmp_path, sim_speedup=200)),
                    health_timeout_s=60, hang_timeout_s=10, report_interval_s=0.2)
    await worker.register([EngineKind.SIMULATOR])
    try:
        unconfigured = start(instance_id="chat/v-1")
        await worker.handle(Envelope.wrap(unconfigured), unconfigured)
        await store.append(f"alias:{ALIAS}", [Envelope.wrap(AliasConfigured(alias=ALIAS, config=CONFIG))])
        forged = start(instance_id="chat/v-2", model_path="/tmp/evil", engine_args={"trust-remote-code": True})
        await worker.handle(Envelope.wrap(forged), forged)
        outcomes = [(e.stream_id, e.payload["outcome"], e.payload["detail"])
                    for e in await store.of_type("InstanceCommandCompleted")]
        assert [(s, o) for s, o, _ in outcomes] == [("instance:chat/v-1", "rejected"), ("instance:chat/v-2", "rejected")]
        assert "not configured" in outcomes[0][2] and "model_path" in outcomes[1][2]
        assert worker.instances == {}  # nothing launched, nothing recorded as starting
        assert await store.of_type("InstanceStateChanged") == []
    finally:
        await worker.shutdown()
