"""Backend types, the engines that implement them, and the capability matrix.

A *backend type* is the role an instance plays in the pool (seed 000 §3.2):
`llama.cpp` is the fast tier, `vllm` the slow, high-throughput tier. An *engine*
is the program that actually runs: the real llama.cpp server, the real
`vllm serve`, or the simulator standing in for either where no GPU exists. The
simulator takes the capabilities of the backend type it mimics, and is always
named as such wherever a user could mistake it for real inference.
"""

from __future__ import annotations

from enum import Enum


class BackendType(str, Enum):
    LLAMA_CPP = "llama.cpp"
    VLLM = "vllm"

    @property
    def tier(self) -> str:
        return "fast" if self is BackendType.LLAMA_CPP else "slow"


class Role(str, Enum):
    """What an instance of a disaggregated alias does (seed 001): prompts (prefill) or generation (decode)."""

    PREFILL = "prefill"
    DECODE = "decode"


class EngineKind(str, Enum):
    LLAMA_CPP = "llama.cpp"
    """modelpool's own engine over llama-cpp-python (continuous batching, KV export and import)."""
    LLAMA_SERVER = "llama-server"
    """llama.cpp's own C++ server, built from the same llama.cpp."""
    VLLM = "vllm"
    SIMULATOR = "simulator"

    @property
    def simulated(self) -> bool:
        return self is EngineKind.SIMULATOR


ENGINES: dict[BackendType, frozenset[EngineKind]] = {
    BackendType.LLAMA_CPP: frozenset({EngineKind.LLAMA_CPP, EngineKind.LLAMA_SERVER, EngineKind.SIMULATOR}),
    BackendType.VLLM: frozenset({EngineKind.VLLM, EngineKind.SIMULATOR}),
}
"""The engines that can run each backend: they speak its engines' API (metrics, `/slots` or sleep mode)."""


def engine_label(engine: EngineKind, backend: BackendType) -> str:
    """How an engine introduces itself: `llama.cpp`, `vllm`, `simulated-vllm`, `simulated-llama.cpp`."""
    return f"simulated-{backend.value}" if engine.simulated else engine.value


class Action(str, Enum):
    """The unified instance interface of seed 000 §3.1 (worker execution plane)."""

    START = "start"
    WAKE = "wake"
    SLEEP = "sleep"
    DRAIN = "drain"
    DELETE = "delete"
    STATUS = "status"


class CommandOutcome(str, Enum):
    """What became of an instance command."""

    OK = "ok"
    UNSUPPORTED = "unsupported"  # the backend cannot do this; the controller picks a substitute
    REJECTED = "rejected"  # not legal in the instance's current state, or not what its alias is configured to run
    FAILED = "failed"  # tried and failed


# Seed 000 §3.2: llama.cpp has start/running/drain/delete and no graded sleep;
# vLLM has start/running/sleep_1/sleep_2/wake/drain/delete.
CAPABILITIES: dict[BackendType, frozenset[Action]] = {
    BackendType.LLAMA_CPP: frozenset({Action.START, Action.DRAIN, Action.DELETE, Action.STATUS}),
    BackendType.VLLM: frozenset(Action),
}

def supports(backend: BackendType, action: Action) -> bool:
    return action in CAPABILITIES[backend]


SUBSTITUTES: dict[tuple[BackendType, Action], tuple[Action, ...]] = {
    # §3.2: "对 llama.cpp 的 sleep 请求，主控直接改用 drain + delete"
    (BackendType.LLAMA_CPP, Action.SLEEP): (Action.DRAIN, Action.DELETE),
}


def substitute(backend: BackendType, action: Action) -> tuple[Action, ...]:
    """The controller's replacement for an unsupported action (empty when there is none)."""
    if supports(backend, action):
        return (action,)
    return SUBSTITUTES.get((backend, action), ())
