"""Training windows and the order they are visited in.

The training text is cut into non-overlapping windows; the last `held_out` windows are kept for
evaluation during training. Which windows make up micro-batch `micro` of optimizer step `step`
on process `rank` is a pure function of those numbers and the seed (one seeded permutation per
pass over the data), so a run resumed from a checkpoint sees exactly the batches the
uninterrupted run would have seen, with no data-loader state to save.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from slimlm.errors import SlimlmError


@dataclass(frozen=True)
class Windows:
    train: torch.Tensor  # [n, seq_len] token ids
    held_out: torch.Tensor  # [m, seq_len]


def cut_windows(token_ids: torch.Tensor, seq_len: int, held_out: int, batch_size: int) -> Windows:
    available = token_ids.numel() // seq_len
    if available < held_out + batch_size:
        raise SlimlmError(
            f"the training text has {token_ids.numel():,} tokens: {available} windows of "
            f"{seq_len}, fewer than the {held_out} held out plus one batch of {batch_size}; "
            "use a longer training text, or lower distill.seq_len, batch_size or eval_windows"
        )
    windows = token_ids[: available * seq_len].view(available, seq_len)
    return Windows(train=windows[: available - held_out], held_out=windows[available - held_out :])


@dataclass(frozen=True)
class BatchOrder:
    windows: int  # training windows available
    batch_size: int  # per process and micro-batch
    accumulation: int
    world: int  # processes
    seed: int

    def indices(self, step: int, micro: int, rank: int) -> torch.Tensor:
        """Window indices of one micro-batch."""
        start = ((step * self.accumulation + micro) * self.world + rank) * self.batch_size
        positions = range(start, start + self.batch_size)
        return torch.tensor(
            [
                int(_permutation(self.windows, self.seed, p // self.windows)[p % self.windows])
                for p in positions
            ]
        )

    def used(self, steps: int) -> torch.Tensor:
        """Every window index some process visits in `steps` optimizer steps (sorted, unique)."""
        total = steps * self.accumulation * self.world * self.batch_size
        passes = -(-total // self.windows)
        if passes > 1:
            return torch.arange(self.windows)
        return _permutation(self.windows, self.seed, 0)[:total].sort().values


@lru_cache(maxsize=4)
def _permutation(windows: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(windows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
