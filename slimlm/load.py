"""The `load` stage: switch the run to another model variant.

Used to evaluate peers and exported models with the same metric code as slimlm's own: the
source model again (optionally quantized on load by bitsandbytes), or a slimlm artifact.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from slimlm.config import BNB_MODES
from slimlm.errors import ConfigError
from slimlm.models import load_model
from slimlm.pipeline import DiskRun, RunState, Stage


@dataclass
class LoadParams:
    bnb: Optional[str] = None  # int8 | nf4: the source model quantized on load by bitsandbytes
    artifact: Optional[str] = None  # a slimlm artifact directory to load instead

    def __post_init__(self) -> None:
        if self.bnb is not None and self.bnb not in BNB_MODES:
            raise ConfigError(
                f"load.bnb='{self.bnb}' is unknown; use {' or '.join(BNB_MODES)}, or leave it out"
            )
        if self.bnb and self.artifact:
            raise ConfigError("load: give either bnb or artifact, not both")


def run(state: RunState, params: LoadParams) -> None:
    state.model = None
    gc.collect()
    base = state.original_model_cfg()
    if params.artifact:
        model_cfg = OmegaConf.merge(base, {"path": params.artifact, "bnb": None})
    else:
        model_cfg = OmegaConf.merge(base, {"bnb": params.bnb})
    state.adopt(load_model(model_cfg, state.device), f"bitsandbytes {params.bnb}" if params.bnb else None)


def always(state: RunState, params: LoadParams) -> bool:
    return True


LOAD = Stage(
    name="load", params=LoadParams, run=run, on_disk=(DiskRun(always, run),)
)  # needs no model loaded before it
