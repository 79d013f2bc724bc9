"""slimlm: compress and distill language models, then run them on small hardware.

Importing slimlm asks torch to back its large CPU tensors with transparent huge pages
(THP_MEM_ALLOC_ENABLE, read at torch's first CPU allocation): decoding reads every weight once
per token, and with 4 KiB pages the page-table walks for a model larger than the processor's
caches cost a quarter of a step (bench/results/decode_families_cpu.md). Set
THP_MEM_ALLOC_ENABLE=0 to keep torch's default.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
