"""One run over several processes (`accelerate launch --num_processes N ... -m slimlm.cli`, or
torchrun): the processes share one run directory, the main process's.

The main process alone claims that directory, resumes it, writes reports and status, and runs the
stages that only read the model (evaluate, export, generate). Every process runs the stages that
make or change it (load, prune, quantize, reconstruct, distill), in memory: each process needs the
model it trains. The distill stage then trains them together (distill/train.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from slimlm.errors import SlimlmError

# How long a process waits at a collective for the others. Evaluation runs on the main process
# alone while the others wait at the next stage's first collective: hours on a CPU.
COLLECTIVE_TIMEOUT = timedelta(hours=6)


@dataclass(frozen=True)
class Launch:
    rank: int = 0
    world: int = 1  # processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world > 1


def current_launch() -> Launch:
    """This process's place in the launch, from the variables accelerate launch and torchrun set."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise SlimlmError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not "
            "whole numbers; start several processes with accelerate launch or torchrun"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise SlimlmError(f"RANK={rank} does not lie within WORLD_SIZE={world}")
    return Launch(rank=rank, world=world)


def from_main(value: Any, cpu: bool) -> Any:
    """`value` as the main process has it, on every process; all processes must call this. The
    first call joins the process group (gloo on the CPU) that accelerate then trains over."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    PartialState(cpu=cpu, timeout=COLLECTIVE_TIMEOUT)
    return broadcast_object_list([value], from_process=0)[0]


def shared_run_dir(own: Path, launch: Launch, cpu: bool, claim: Callable[[Path], bool]) -> tuple[Path, bool]:
    """The run directory every process uses and whether the run resumes an unfinished one: the
    main process claims its own (Hydra made one per process) and tells the others, who remove
    theirs. Only the main process is told that the run resumes: it alone replaces outputs."""
    if not launch.several:
        return own, claim(own)
    claimed: Optional[tuple[str, bool]] = None
    error = ""
    if launch.is_main:
        try:
            claimed = (str(own), claim(own))
        except SlimlmError as refusal:
            error = str(refusal)
    claimed, error = from_main((claimed, error), cpu)
    if claimed is None:
        raise SlimlmError(error if launch.is_main else f"the main process stopped: {error}")
    shared, resumes = Path(claimed[0]), claimed[1]
    return shared, resumes and launch.is_main
