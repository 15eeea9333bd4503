"""The simulated engine's pure parts: settings layering, lifecycle transitions and memory, synthetic text."""

from __future__ import annotations

import pytest

from services.engines.simulated import synthetic
from services.engines.simulated.config import GIB, EngineConfig
from services.engines.simulated.lifecycle import EngineState, Lifecycle, LifecycleError
from shared.contracts.config import ConfigError


def test_settings_layer_profile_then_env_then_arguments() -> None:
    env = {"MODELPOOL_SIM_ENGINE_SPEEDUP": "5", "MODELPOOL_SIM_ENGINE_MODEL": "from-env"}
    config = EngineConfig.resolve("vllm", env=env, model="from-args", port=None)
    assert config.speedup == 5.0  # environment over the default
    assert config.model == "from-args"  # argument over the environment
    assert config.port == 8000  # None means "not given"
    assert config.startup_s == 60.0 and config.wake_l1_s == 0.3 and config.wake_l2_s == 2.6
    llama = EngineConfig.resolve("llama.cpp", env={})
    assert llama.port == 8080 and llama.max_num_seqs == 4 and llama.startup_s < 5
    assert llama.engine_name == "simulated-llama.cpp"


def test_profile_variables_come_after_engine_variables_and_before_arguments() -> None:
    env = {"MODELPOOL_SIM_ENGINE_STARTUP_S": "5", "MODELPOOL_SIM_ENGINE_SPEEDUP": "2",
           "MODELPOOL_SIM_VLLM_STARTUP_S": "600", "MODELPOOL_SIM_VLLM_FAIL_START": "true",
           "MODELPOOL_SIM_LLAMA_CPP_MAX_NUM_SEQS": "6"}
    vllm = EngineConfig.resolve("vllm", env=env)
    assert vllm.startup_s == 600.0 and vllm.fail_start is True  # the profile's own variables win
    assert vllm.speedup == 2.0 and vllm.max_num_seqs == 256  # engine-wide ones still apply; others' do not
    llama = EngineConfig.resolve("llama.cpp", env=env)
    assert llama.startup_s == 5.0 and llama.fail_start is False and llama.max_num_seqs == 6
    assert EngineConfig.resolve("vllm", env=env, startup_s=1.0).startup_s == 1.0  # arguments win over both


def test_kv_capacity_follows_memory_and_must_hold_one_full_context() -> None:
    config = EngineConfig.resolve("vllm", env={})
    expected = int((24 * 0.9 - 4.3 - 0.5) * GIB) // 114_688
    assert config.kv_tokens == expected
    with pytest.raises(ConfigError, match="KV capacity"):
        EngineConfig.resolve("vllm", env={}, kv_cache_tokens=1000, max_model_len=8000)
    with pytest.raises(ConfigError, match="KV capacity"):
        EngineConfig.resolve("vllm", env={}, max_model_len=262144)  # more than the KV pool holds
    llama = EngineConfig.resolve("llama.cpp", env={}, max_model_len=32768)
    assert llama.kv_tokens == 32768 * llama.max_num_seqs  # one context per slot
    with pytest.raises(ConfigError, match="speedup in environment variable MODELPOOL_SIM_ENGINE_SPEEDUP"):
        EngineConfig.resolve("vllm", env={"MODELPOOL_SIM_ENGINE_SPEEDUP": "0"})


def test_lifecycle_sleep_levels_and_memory() -> None:
    config = EngineConfig.resolve("vllm", env={})
    life = Lifecycle(config)
    assert life.state is EngineState.LOADING and not life.serving
    life.loaded()
    awake = life.memory()
    assert awake.cpu_bytes == 0 and awake.gpu_bytes > int(config.weights_gib * GIB)
    assert life.begin_sleep(1) is True
    assert life.is_sleeping and not life.serving and life.state is EngineState.DRAINING
    with pytest.raises(LifecycleError):
        life.begin_wake()  # still draining
    life.asleep()
    level1 = life.memory()
    assert level1.cpu_bytes == int(config.weights_gib * GIB)
    assert level1.gpu_bytes == int(config.residual_gib * GIB)
    assert life.sleep_state_label() == "weights_offloaded"
    assert life.begin_sleep(2) is False  # already asleep: no-op
    assert life.begin_wake() == config.wake_l1_s
    life.awake()
    assert life.memory() == awake and life.sleep_state_label() == "awake"
    life.begin_sleep(2)
    life.asleep()
    assert life.memory().cpu_bytes == 0 and life.sleep_state_label() == "discard_all"
    assert life.begin_wake() == 0.0  # level 2: the weights' memory is only remapped, empty
    life.awake()
    assert life.state is EngineState.AWAKE and life.weights_lost and not life.serving
    assert life.begin_reload() == config.wake_l2_s  # reload_weights: the level-2 wake's cost
    life.end_reload(True)
    assert life.serving and life.memory() == awake
    with pytest.raises(LifecycleError):
        life.begin_sleep(3)


def test_level_2_wakes_tag_by_tag_and_needs_its_weights_reloaded() -> None:
    config = EngineConfig.resolve("vllm", env={})
    life = Lifecycle(config)
    life.loaded()
    life.begin_sleep(2)
    life.asleep()
    with pytest.raises(LifecycleError):
        life.begin_reload()  # the weights' memory is still asleep
    assert life.begin_wake(frozenset({"weights"})) == 0.0
    life.awake()
    assert life.state is EngineState.SLEEPING and life.is_sleeping and life.sleeping_tags == {"kv_cache"}
    assert life.memory().gpu_bytes == int((config.residual_gib + config.weights_gib) * GIB)  # no KV cache yet
    assert life.begin_wake(frozenset({"weights"})) is None  # not asleep: a no-op, as in vLLM
    life.begin_reload()
    life.end_reload(False)  # interrupted: still lost
    assert life.weights_lost
    life.begin_reload()
    life.end_reload(True)
    assert not life.serving  # the KV cache still sleeps
    life.begin_wake(frozenset({"kv_cache"}))
    life.awake()
    assert life.serving and not life.is_sleeping and life.level == 0


def test_llamacpp_lifecycle_has_no_sleep() -> None:
    life = Lifecycle(EngineConfig.resolve("llama.cpp", env={}))
    life.loaded()
    with pytest.raises(LifecycleError):
        life.begin_sleep(1)
    assert life.memory().gpu_bytes == 0 and life.memory().cpu_bytes > 0


def test_token_estimate_and_shared_chat_prefixes() -> None:
    assert synthetic.count_tokens("Hello, world!") == 4
    assert synthetic.count_tokens("internationalization") == 4  # long words split in 6-letter runs
    turn1 = synthetic.chat_pieces([("system", "be brief " * 20), ("user", "first question")])
    turn2 = synthetic.chat_pieces([("system", "be brief " * 20), ("user", "first question"),
                                   ("assistant", "an answer"), ("user", "second question")])
    assert turn2[: len(turn1) - 3] == turn1[:-3]  # everything before the assistant header is shared
    assert turn1[-3:] == ["<|im_start|>", "assistant", "\n"]


def test_filler_text_is_deterministic_and_one_word_per_token() -> None:
    filler = synthetic.FillerText.build()
    text = filler.text(seed=11, count=25)
    assert text == filler.text(seed=11, count=25)
    assert len(text.split()) == 25 and text[0].isupper()
    assert b"".join(filler.token(11, i) for i in range(25)).decode() == text
    assert filler.text(seed=12, count=25) != text


@pytest.mark.parametrize("mean", [1, 7, 256])
def test_natural_length_stays_in_its_band(mean: int) -> None:
    lengths = {synthetic.natural_length(seed, mean) for seed in range(2000)}
    assert min(lengths) >= max(1, mean // 2) and max(lengths) <= max(1, mean // 2) + mean
    assert len(lengths) > min(mean, 5) // 2


def test_image_parts_cost_a_block_of_tokens_and_identify_the_image() -> None:
    def image(url: str) -> list[dict]:
        return [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]

    a = synthetic.content_pieces(image("https://example.com/a.png"))
    b = synthetic.content_pieces(image("https://example.com/b.png"))
    assert len(a) == 3 + synthetic.IMAGE_TOKENS
    assert a[:3] == b[:3] and a[3:] != b[3:]
    assert synthetic.content_pieces(image("https://example.com/a.png")) == a
