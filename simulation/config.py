"""Experiment configuration: the YAML keys of seed 002, validated.

Layers, lowest first: the defaults below, then the YAML file, then the
environment (`MODELPOOL_SIM_EXPERIMENTS_DIR`, `MODELPOOL_SIM_REQUEST_FILE`),
then explicit command-line arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.configuration import from_environment, layered, read_yaml
from simulation.core import PreemptionMode, Strategy, SystemParams, VictimPolicy


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SystemSection(_Section):
    M_total: int = Field(10_000, gt=0, description="GPU memory capacity in tokens")
    B: int = Field(2_000, gt=0, description="token budget of an executed batch")
    d_0: float = Field(1.0, ge=0, description="base duration of a batch")
    d_1: float = Field(0.001, ge=0, description="marginal duration per batch token")


class ControlSection(_Section):
    preemption_mode: PreemptionMode = PreemptionMode.SWAP
    preemption_strategy: Strategy = Strategy.CONSERVATIVE
    allow_waiting_preempt: bool = False
    queue_policy: Literal["FCFS"] = "FCFS"
    victim_policy: VictimPolicy = VictimPolicy.LIFO

    @field_validator("preemption_mode", "preemption_strategy", "victim_policy", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("queue_policy", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class DataSection(_Section):
    request_file: str = "experiments/input/requests.csv"
    experiments_dir: str = "experiments"
    L_filter: int | None = Field(None, gt=0, description="drop requests decoding more tokens than this")


class ExperimentSection(_Section):
    seed: int = 42
    verbose: bool = True
    progress_interval: int = Field(100, gt=0, description="batches between progress-bar refreshes")
    # beyond the seed's keys: sampling of the heavier outputs
    window_batches: int = Field(50, gt=0, description="plot/rate window, in batches of d_0 + d_1*B")
    queue_timeline_interval: int = Field(10, gt=0, description="batches between queue membership rows")


class TruncationSection(_Section):
    at_batch: int | None = Field(None, ge=0)
    new_rate: float | None = Field(None, gt=0)
    new_n: int | None = Field(None, gt=0)
    candidates: int = Field(5, gt=0, description="candidate truncation points marked in explore mode")


class SimConfig(_Section):
    system: SystemSection = SystemSection()
    control: ControlSection = ControlSection()
    data: DataSection = DataSection()
    experiment: ExperimentSection = ExperimentSection()
    truncation: TruncationSection = TruncationSection()

    def params(self) -> SystemParams:
        return SystemParams(
            M_total=self.system.M_total,
            B=self.system.B,
            d_0=self.system.d_0,
            d_1=self.system.d_1,
            mode=self.control.preemption_mode,
            strategy=self.control.preemption_strategy,
            victim_policy=self.control.victim_policy,
            allow_waiting_preempt=self.control.allow_waiting_preempt,
            seed=self.experiment.seed,
        )

    def with_control(
        self,
        mode: PreemptionMode | None = None,
        strategy: Strategy | None = None,
        victim_policy: VictimPolicy | None = None,
    ) -> SimConfig:
        update = {"preemption_mode": mode, "preemption_strategy": strategy, "victim_policy": victim_policy}
        control = self.control.model_copy(update={k: v for k, v in update.items() if v})
        return self.model_copy(update={"control": control})

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


DEFAULT_CONFIG = Path(__file__).with_name("configs") / "default.yaml"


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SimConfig:
    """Defaults <- YAML file <- environment <- `overrides` (nested dict of sections), as `shared/configuration.py`
    layers every section."""
    env = os.environ if env is None else env
    data_env = from_environment(env, {"experiments_dir": "MODELPOOL_SIM_EXPERIMENTS_DIR",
                                      "request_file": "MODELPOOL_SIM_REQUEST_FILE"})
    return layered(SimConfig, [(str(path), read_yaml(path, "a mapping of sections (system, control, data, experiment)")) if path is not None else ("<defaults>", {}),
                               *((source, {"data": values}) for source, values in data_env),
                               ("arguments", overrides or {})])
