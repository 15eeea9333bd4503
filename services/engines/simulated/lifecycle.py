"""The engine's lifecycle as vLLM's sleep mode documents it, with memory accounting.

Pure state machine: methods validate a transition and return the delay it takes;
the server does the waiting. States:

    LOADING -> AWAKE -> DRAINING -> SLEEPING(1|2) -> WAKING -> (SLEEPING ->) AWAKE

vLLM tags its GPU memory `weights` and `kv_cache`; a sleep puts both to sleep:
- level 1: the weights are offloaded to CPU memory, the KV cache is discarded;
- level 2: the weights and the KV cache are discarded (buffers stay in CPU memory).
`/wake_up` wakes every sleeping tag, or those named (`?tags=weights`); the engine
counts as sleeping until both are awake. Waking level-2 weights only remaps empty
memory: they must be loaded again (`/collective_rpc` `reload_weights`) before the
engine can answer, else a real vLLM computes with garbage — here, every request is
refused saying so (`weights_lost`). The prefix cache is empty after any sleep.

DRAINING: once sleep is asked for, new requests are refused while the ones in
flight are aborted (vLLM's default `mode=abort`) or finish first (`mode=wait`).
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
WEIGHTS, KV_CACHE = "weights", "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)


class Lifecycle:
    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self.state = EngineState.LOADING
        self.level = 0
        """Sleep level while DRAINING / SLEEPING / WAKING (0 when awake)."""
        self.sleeping_tags: frozenset[str] = frozenset()
        """Memory tags asleep (both from the sleep until a wake names them)."""
        self._waking: frozenset[str] = frozenset()
        self.weights_lost = False
        """Level 2 discarded the weights and they have not been loaded again since."""
        self.reloading = False
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
        self.sleeping_tags = frozenset(MEMORY_TAGS)
        self.weights_lost = self.weights_lost or self.level == 2

    def begin_wake(self, tags: frozenset[str] | None = None) -> float | None:
        """Start waking `tags` (None: all); returns the delay, or None when none of them sleeps (a no-op,
        as in vLLM, unknown tags included)."""
        self._require_sleep_mode()
        if self.state is EngineState.AWAKE:
            return None
        if self.state is not EngineState.SLEEPING:
            raise LifecycleError(f"cannot wake while {self.state.value}")
        waking = self.sleeping_tags & (tags if tags is not None else frozenset(MEMORY_TAGS))
        if not waking:
            return None
        self.state, self._waking = EngineState.WAKING, waking
        # Level 1 copies the weights back from CPU memory; level 2 only remaps empty memory (the
        # reload is its own call), and the KV cache is allocated empty: neither is modelled as taking time.
        return self._config.wake_l1_s if WEIGHTS in waking and self.level == 1 else 0.0

    def awake(self) -> None:
        if self.state is not EngineState.WAKING:
            raise LifecycleError(f"engine is {self.state.value}, not waking")
        self.sleeping_tags -= self._waking
        self._waking = frozenset()
        if self.sleeping_tags:
            self.state = EngineState.SLEEPING
        else:
            self.state, self.level = EngineState.AWAKE, 0

    def begin_reload(self) -> float:
        """Start loading the weights again (`reload_weights`); returns the delay. Their memory must be awake."""
        self._require_sleep_mode()
        if self.state not in (EngineState.AWAKE, EngineState.SLEEPING) or WEIGHTS in self.sleeping_tags:
            raise LifecycleError("reload_weights needs the weights' memory awake: "
                                 "POST /wake_up?tags=weights first")
        if self.reloading:
            raise LifecycleError("the weights are already being reloaded")
        self.reloading = True
        return self._config.wake_l2_s

    def end_reload(self, loaded: bool) -> None:
        self.reloading = False
        self.weights_lost = self.weights_lost and not loaded

    # ------------------------------------------------------------ views

    @property
    def serving(self) -> bool:
        return self.state is EngineState.AWAKE and not self.weights_lost and not self.reloading

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
        # vLLM reserves its whole KV pool at start-up, so GPU use does not follow load.
        kv = c.kv_tokens * c.kv_bytes_per_token
        if self.state is EngineState.SLEEPING or self.state is EngineState.WAKING:
            weights_asleep = WEIGHTS in self.sleeping_tags
            return MemoryFootprint(
                gpu_bytes=residual + (0 if weights_asleep else weights) + (0 if KV_CACHE in self.sleeping_tags else kv),
                cpu_bytes=weights if weights_asleep and self.level == 1 else 0)
        return MemoryFootprint(gpu_bytes=residual + weights + kv, cpu_bytes=0)

    def _require_sleep_mode(self) -> None:
        if not self.supports_sleep:
            raise LifecycleError(f"the {self._config.profile} profile has no sleep mode")
