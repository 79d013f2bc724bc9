"""Text data through `datasets`: local text or jsonl files (or a hub data set when reachable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from slimlm.config import TextSourceConfig
from slimlm.errors import SlimlmError
from slimlm.resources import resolve_path

FORMATS = ("text", "jsonl", "hub")


def check_text_source(src: TextSourceConfig, role: str) -> Optional[Path]:
    """Fail early, naming the file and where it comes from, if a data file is missing or is not
    UTF-8 text (jsonl: one JSON object per line). Reading it once costs about a second per GB."""
    if src.format not in FORMATS:
        raise SlimlmError(f"data.{role}.format='{src.format}' is unknown; use one of {', '.join(FORMATS)}")
    if src.format == "hub":
        return None  # only the download can tell whether the hub has it
    path = resolve_path(src.path)
    if not path.is_file():
        raise SlimlmError(
            f"data file for data.{role} not found: '{src.path}'. The bundled demo data needs no setup "
            "(data=demo); other data sets are read from the folder in $SLIMLM_DATA_DIR (data=shared)"
        )
    # whether anything but whitespace was seen: an empty file is refused now, not after the
    # model loads
    text = False
    try:
        with open(
            path, encoding="utf-8", newline="\n"
        ) as handle:  # lines end at \n alone, as datasets reads jsonl
            if src.format == "jsonl":
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    if not isinstance(json_object(line), dict):
                        raise SlimlmError(
                            f"data.{role}: line {number} of '{src.path}' is not a "
                            "JSON object; a jsonl file holds one object per line"
                        )
                    text = True
            else:
                while piece := handle.read(1 << 24):  # in pieces: memory stays bounded for a large corpus
                    text = text or bool(piece.strip())
    except UnicodeDecodeError:
        raise SlimlmError(f"data.{role}: '{src.path}' is not UTF-8 text; convert it to UTF-8") from None
    if not text:
        raise SlimlmError(f"data.{role}: '{src.path}' contains no text")
    return path


def json_object(line: str) -> object:
    """The JSON value of a line, or None if it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def load_text(src: TextSourceConfig, role: str) -> str:
    """The whole source as one string; line endings normalised to \\n."""
    from datasets import load_dataset

    path = check_text_source(src, role)
    if src.format == "text":
        texts = load_dataset("text", data_files=str(path), sample_by="document", split="train")["text"]
    else:
        if src.format == "jsonl":
            dataset = load_dataset("json", data_files=str(path), split="train")
        else:
            try:
                dataset = load_dataset(src.path, src.subset, split=src.split)
            except Exception as error:  # offline, unknown id or split: datasets raises many kinds
                raise SlimlmError(
                    f"data.{role}: could not load hub data set '{src.path}' "
                    f"({str(error).splitlines()[0]}); without network, use a local text or jsonl file"
                ) from None
        if src.field not in dataset.column_names:
            raise SlimlmError(
                f"data.{role}: '{src.path}' has no field '{src.field}'; its fields are {dataset.column_names}"
            )
        texts = dataset[src.field]
    text = "\n\n".join(t.replace("\r\n", "\n") for t in texts if t)
    if not text.strip():
        raise SlimlmError(f"data.{role}: '{src.path}' contains no text")
    return text


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """A whole text as one 1-D tensor of token ids, without special tokens (windows are cut later)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
