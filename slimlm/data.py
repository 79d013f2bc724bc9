"""Text data through `datasets`: local text or jsonl files (or a hub data set when reachable)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from slimlm.config import DataConfig, TextSourceConfig
from slimlm.errors import SlimlmError
from slimlm.resources import cache_dir, resolve_path
from slimlm.rundir import load_cached_tensors, save_tensors_atomic

FORMATS = ("text", "jsonl", "hub")
MODEL_FORMAT = "model"  # calibration text sampled from the original model


def check_text_source(src: TextSourceConfig, role: str) -> Optional[Path]:
    """Fail early, naming the file and where it comes from, if a data file is missing or is not
    UTF-8 text (jsonl: one JSON object per line). Reading it once costs about a second per GB."""
    if src.format == MODEL_FORMAT and role == "calibration":
        return None  # sampled from the model (slimlm/model_samples.py): no file to check
    if src.format not in FORMATS:
        formats = ", ".join((*FORMATS, MODEL_FORMAT) if role == "calibration" else FORMATS)
        raise SlimlmError(f"data.{role}.format='{src.format}' is unknown; use one of {formats}")
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


def describe_calibration(data: DataConfig) -> str:
    """Where the calibration and training text comes from, in a report's words: the file, or the
    sampling settings (which, like a file, decide what a resumed training may go on from)."""
    if data.calibration.format != MODEL_FORMAT:
        return str(data.calibration.path)
    sampling = data.sampling
    return (
        f"samples of the original model ({sampling.tokens:,} tokens, {sampling.length} a sample, "
        f"temperature {sampling.temperature:g}, seed {sampling.seed})"
    )


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


def tokenize_text_cached(tokenizer, text: str) -> torch.Tensor:
    """tokenize_text, kept in the cache under the hash of the text and of the tokenizer's whole
    definition: the 30-book calibration corpus takes 17 s to tokenize, which every calibrating
    stage paid again. A tokenizer without a serialisable definition (a slow one) is not cached."""
    key = _tokenization_key(tokenizer, text)
    if key is None:
        return tokenize_text(tokenizer, text)
    path = cache_dir() / "tokens" / f"{key}.safetensors"
    cached = load_cached_tensors(path, "token cache", ("ids",))
    if cached is not None:
        return cached["ids"]
    ids = tokenize_text(tokenizer, text)
    save_tensors_atomic(path, {"ids": ids})
    return ids


def _tokenization_key(tokenizer, text: str) -> Optional[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import tokenizers

    digest = hashlib.sha256(f"tokenizers {tokenizers.__version__}\n".encode())
    digest.update(backend.to_str().encode())
    digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()
