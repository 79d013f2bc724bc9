"""Choosing modules by name: `targets` and `ignore` regex patterns (llm-compressor's idea)."""

from __future__ import annotations

import re
from typing import Sequence

from torch import nn

from slimlm.errors import SlimlmError


def compile_patterns(patterns: Sequence[str]) -> dict[str, re.Pattern]:
    """Each pattern compiled; an invalid one refused (configs check theirs before any work)."""
    compiled = {}
    for pattern in patterns:
        try:
            compiled[pattern] = re.compile(pattern)
        except re.error as error:
            raise SlimlmError(f"pattern '{pattern}' is not a valid regular expression: {error}") from None
    return compiled


def select_linear_modules(model: nn.Module, targets: Sequence[str], ignore: Sequence[str]) -> list[str]:
    """Names of nn.Linear modules that fully match a target and no ignore pattern.

    A pattern that matches no Linear module at all is an error: it is almost always a typo,
    and silently quantizing less than the recipe says would mislead every later number.
    """
    linear_names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    compiled = compile_patterns([*targets, *ignore])
    for pattern in compiled:
        if not any(compiled[pattern].fullmatch(name) for name in linear_names):
            example = linear_names[0] if linear_names else "(none)"
            raise SlimlmError(f"pattern '{pattern}' matches no Linear module; names look like '{example}'")
    return [
        name
        for name in linear_names
        if any(compiled[p].fullmatch(name) for p in targets)
        and not any(compiled[p].fullmatch(name) for p in ignore)
    ]
