"""The finished blocks of an offloaded calibration, kept on disk so that a killed run resumes.

Calibrating an 8B model one block at a time takes hours on a CPU (bench/results/scale.md). After
each block, its tensors, what the report says about it, and the hidden states the next block
takes are written into a directory of their own (each file atomically, the hidden states last:
they say which block comes next). A rerun with the same checkpoint, settings and calibration
windows starts at that block, with exactly the inputs it would have had, so its artifact equals
an uninterrupted run's. A directory another calibration wrote is refused, naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from slimlm.checkpoint import Checkpoint
from slimlm.errors import SlimlmError
from slimlm.rundir import save_tensors_atomic, write_atomic

log = logging.getLogger("slimlm")

FINGERPRINT = "fingerprint.json"
INPUTS = "next-inputs.safetensors"  # the hidden states the next unfinished block takes, chunk by chunk


@dataclass(frozen=True)
class BlockFacts:
    """What the artifact's manifest and the report keep of one calibrated block."""

    name: str
    seconds: float
    records: dict[str, dict]  # the manifest records of the block's quantized layers
    weight_rel_error: dict[str, float]
    uncalibrated: list[str]  # experts no calibration token reached, rounded instead
    awq_output_error: dict[str, list[float]]


def calibration_fingerprint(
    checkpoint: Checkpoint, params: object, samples: torch.Tensor, dtype: Optional[torch.dtype]
) -> dict:
    """What a resumed calibration must share with the run that wrote the blocks: the checkpoint
    (its config and the names and sizes of its weights files), the settings, the calibration
    windows and the dtype."""
    directory = checkpoint.directory
    files = [[path.name, path.stat().st_size] for path in checkpoint.weight_files()]
    config = hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()
    windows = hashlib.sha256(samples.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return {
        "checkpoint": {"config_sha256": config, "weights_files": files},
        "settings": json.loads(json.dumps(dataclasses.asdict(params))),
        "samples": {"shape": list(samples.shape), "sha256": windows},
        "dtype": str(dtype),
    }


class BlockProgress:
    """A calibration's progress directory: blocks `block-N.safetensors` with their facts
    `block-N.json`, and the inputs of the next block."""

    def __init__(self, directory: Path, fingerprint: dict):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        written = self.directory / FINGERPRINT
        if not written.is_file():
            write_atomic(written, json.dumps(fingerprint, indent=2) + "\n")
            return
        try:
            earlier = json.loads(written.read_text())
        except ValueError:
            earlier = {}
        if earlier != fingerprint:
            differs = (
                sorted(
                    key for key in set(earlier) | set(fingerprint) if earlier.get(key) != fingerprint.get(key)
                )
                if isinstance(earlier, dict)
                else ["all"]
            )
            raise SlimlmError(
                f"'{self.directory}' holds the blocks of another calibration "
                f"(it differs in {', '.join(differs)}); rerun with the settings, checkpoint and data "
                "that wrote it to resume, or remove it to start over"
            )

    def resume_point(self) -> tuple[int, Optional[list[torch.Tensor]]]:
        """The first unfinished block's index and its inputs (0 and None on a fresh start)."""
        path = self.directory / INPUTS
        if not path.is_file():
            return 0, None
        with safe_open(path, framework="pt") as handle:
            start = int(handle.metadata()["next_block"])
            chunks = sorted(handle.keys(), key=lambda key: int(key.split(".")[1]))
            hidden = [handle.get_tensor(key) for key in chunks]
        missing = [index for index in range(start) if not self._facts_path(index).is_file()]
        if missing:
            raise SlimlmError(
                f"'{self.directory}' lacks block {missing[0]}, which it says is finished; "
                "remove it to start over"
            )
        log.info(
            "'%s' holds %d finished block(s) of this calibration from an earlier run: going on from block %d",
            self.directory,
            start,
            start,
        )
        return start, hidden

    def finished(self, count: int) -> list[BlockFacts]:
        """The facts of blocks 0 .. count-1."""
        return [BlockFacts(**json.loads(self._facts_path(index).read_text())) for index in range(count)]

    def save(
        self, index: int, tensors: dict[str, torch.Tensor], facts: BlockFacts, next_inputs: list[torch.Tensor]
    ) -> None:
        """Block `index` is done: its tensors and facts, then the next block's inputs."""
        save_tensors_atomic(self.directory / f"block-{index}.safetensors", tensors)
        write_atomic(self._facts_path(index), json.dumps(dataclasses.asdict(facts)) + "\n")
        chunks = {f"chunk.{i}": hidden.detach().cpu().contiguous() for i, hidden in enumerate(next_inputs)}
        save_tensors_atomic(self.directory / INPUTS, chunks, {"next_block": str(index + 1)})

    def _facts_path(self, index: int) -> Path:
        return self.directory / f"block-{index}.json"


def finished_tensor_files(directory: Path) -> dict[str, Path]:
    """Every finished block's tensor names in a progress directory, with the file that holds each."""
    found: dict[str, Path] = {}
    for path in sorted(Path(directory).glob("block-*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            found.update(dict.fromkeys(handle.keys(), path))
    return found
