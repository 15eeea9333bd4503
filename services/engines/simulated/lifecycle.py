"""The engine's lifecycle as vLLM's sleep mode documents it, with memory accounting.

Pure state machine: methods validate a transition and return the delay it takes;
the server does the waiting. States:

    LOADING -> AWAKE -> DRAINING -> SLEEPING(1|2) -> WAKING -> AWAKE

- level 1: weights are offloaded to CPU memory, the KV cache is discarded;
- level 2: weights and KV cache are discarded (buffers stay in CPU memory);
- waking takes the per-level wake delay; the prefix cache is empty afterwards.

DRAINING is modelling policy, not vLLM's: once sleep is asked for, new requests
are refused and the ones in flight finish before the weights go away, so a
sleep command never loses a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from services.engines.simulated.config import GIB, EngineConfig


class EngineState(str, Enum):
    LOADING = "loading"
    AWAKE = "awake"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    WAKING = "waking"


class LifecycleError(Exception):
    """A transition that the current state does not allow."""


@dataclass(frozen=True)
class MemoryFootprint:
    gpu_bytes: int
    cpu_bytes: int


# vLLM's `vllm:engine_sleep_state` label values.
SLEEP_STATE_LABELS = ("awake", "weights_offloaded", "discard_all")


class Lifecycle:
    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self.state = EngineState.LOADING
        self.level = 0
        """Sleep level while DRAINING / SLEEPING / WAKING (0 when awake)."""
        self.supports_sleep = config.profile == "vllm"

    # ------------------------------------------------------------ transitions

    def loaded(self) -> None:
        if self.state is not EngineState.LOADING:
            raise LifecycleError(f"engine is {self.state.value}, not loading")
        self.state = EngineState.AWAKE

    def begin_sleep(self, level: int) -> bool:
        """Start going to sleep; False when already asleep (a no-op, as in vLLM)."""
        self._require_sleep_mode()
        if level not in (1, 2):
            raise LifecycleError(f"sleep level must be 1 or 2, got {level}")
        if self.state is EngineState.SLEEPING:
            return False
        if self.state is not EngineState.AWAKE:
            raise LifecycleError(f"cannot sleep while {self.state.value}")
        self.state = EngineState.DRAINING
        self.level = level
        return True

    def sleep_delay(self) -> float:
        return self._config.sleep_l1_s if self.level == 1 else self._config.sleep_l2_s

    def asleep(self) -> None:
        if self.state is not EngineState.DRAINING:
            raise LifecycleError(f"engine is {self.state.value}, not draining")
        self.state = EngineState.SLEEPING

    def begin_wake(self) -> float | None:
        """Start waking; returns the delay, or None when already awake (a no-op)."""
        self._require_sleep_mode()
        if self.state is EngineState.AWAKE:
            return None
        if self.state is not EngineState.SLEEPING:
            raise LifecycleError(f"cannot wake while {self.state.value}")
        self.state = EngineState.WAKING
        return self._config.wake_l1_s if self.level == 1 else self._config.wake_l2_s

    def awake(self) -> None:
        if self.state is not EngineState.WAKING:
            raise LifecycleError(f"engine is {self.state.value}, not waking")
        self.state = EngineState.AWAKE
        self.level = 0

    # ------------------------------------------------------------ views

    @property
    def serving(self) -> bool:
        return self.state is EngineState.AWAKE

    @property
    def is_sleeping(self) -> bool:
        """What `GET /is_sleeping` answers: true from the sleep call until wake-up completes."""
        return self.state in (EngineState.DRAINING, EngineState.SLEEPING, EngineState.WAKING)

    def sleep_state_label(self) -> str:
        if self.state in (EngineState.SLEEPING, EngineState.WAKING):
            return SLEEP_STATE_LABELS[self.level]
        return "awake"

    def memory(self) -> MemoryFootprint:
        c = self._config
        weights = int(c.weights_gib * GIB)
        residual = int(c.residual_gib * GIB)
        if c.profile == "llama.cpp":
            # CPU inference: weights are mapped into RAM, the KV cache is allocated at start.
            kv = c.kv_tokens * c.kv_bytes_per_token
            loaded = self.state is not EngineState.LOADING
            return MemoryFootprint(gpu_bytes=0, cpu_bytes=weights + kv if loaded else 0)
        if self.state is EngineState.LOADING:
            return MemoryFootprint(gpu_bytes=residual, cpu_bytes=0)
        if self.state is EngineState.SLEEPING or self.state is EngineState.WAKING:
            offloaded = weights if self.level == 1 else 0
            return MemoryFootprint(gpu_bytes=residual, cpu_bytes=offloaded)
        # vLLM reserves its whole KV pool at start-up, so GPU use does not follow load.
        return MemoryFootprint(gpu_bytes=residual + weights + c.kv_tokens * c.kv_bytes_per_token, cpu_bytes=0)

    def _require_sleep_mode(self) -> None:
        if not self.supports_sleep:
            raise LifecycleError(f"the {self._config.profile} profile has no sleep mode")
