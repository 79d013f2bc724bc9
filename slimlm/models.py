"""Model loading, one entry point for every stage: HF directory, GGUF file or hub id.

A GGUF file is dequantized by transformers once and cached as a safetensors checkpoint keyed
by the file's sha256, so later runs load in about a second instead of converting again.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from slimlm.architecture import check_compressible
from slimlm.artifact import MANIFEST, load_artifact
from slimlm.config import ModelConfig
from slimlm.errors import SlimlmError
from slimlm.experts import split_experts
from slimlm.model_config import first_line
from slimlm.resources import cache_dir, read_json_object, resolve_path, sha256_file

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, decided without reading its weights."""

    id: str  # what the user wrote (path or hub id)
    kind: str  # "hf-dir" | "gguf" | "hub" | "artifact"
    path: Optional[Path]  # local file or directory; None for a hub id
    architecture: Optional[str]  # model_type, when it can be read without loading
    context_length: Optional[int] = None  # the model's maximum positions, when known up front


def resolve_model(cfg: ModelConfig) -> ModelSource:
    """Classify and check a model path; reads only config.json or the GGUF header."""
    path = resolve_path(cfg.path)
    if path.is_file() and path.suffix == ".gguf":
        source = ModelSource(cfg.path, "gguf", path, *_gguf_header(path))
    elif path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise SlimlmError(
                f"model.path '{cfg.path}' is a directory without config.json: point it at "
                "a Hugging Face checkpoint directory, a slimlm artifact or a .gguf file"
            )
        config = read_json_object(config_file, "fix or replace the checkpoint's config.json")
        kind = "artifact" if (path / MANIFEST).is_file() else "hf-dir"
        source = ModelSource(
            cfg.path, kind, path, config.get("model_type"), config.get("max_position_embeddings")
        )
    elif path.exists():
        raise SlimlmError(f"model.path '{cfg.path}' is neither a checkpoint directory nor a .gguf file")
    elif HUB_ID.match(cfg.path) and not cfg.path.startswith((".", "/", "~")):
        source = ModelSource(cfg.path, "hub", None, None)
    else:
        raise SlimlmError(
            f"model.path '{cfg.path}' does not exist: give a local "
            "checkpoint directory, a .gguf file or a hub id (org/name)"
        )
    architecture = (
        gguf_model_type(cfg.path, source.architecture) if source.kind == "gguf" else source.architecture
    )
    check_compressible(cfg.path, architecture)
    return source


# llama.cpp's names for architectures that transformers calls otherwise
GGUF_ARCHITECTURES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


def gguf_model_type(path: str, architecture: str) -> str:
    """The transformers model type of a GGUF file's architecture, refused in one line where
    transformers cannot read such files (it converts them to a checkpoint for every stage)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    model_type = GGUF_ARCHITECTURES.get(architecture, architecture)
    if model_type not in GGUF_SUPPORTED_ARCHITECTURES:
        raise SlimlmError(
            f"model '{path}' is a GGUF file of architecture '{architecture}', which transformers "
            f"cannot read (it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); "
            "give a Hugging Face checkpoint directory instead"
        )
    return model_type


def _gguf_header(path: Path) -> tuple[str, Optional[int]]:
    """Architecture and context length from a GGUF file's key/value header (no vocabulary, no tensors: seconds
    even for a 262k-token vocabulary)."""
    from slimlm.gguf_header import read_gguf_header

    metadata = read_gguf_header(path).metadata
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise SlimlmError(
            f"GGUF file '{path.name}' has no general.architecture key; it was not written by a GGUF converter"
        )
    context = metadata.get(f"{architecture}.context_length")
    return architecture, (int(context) if isinstance(context, int) else None)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: ModelSource
    sha256: Optional[str]  # of the GGUF file or the checkpoint's weight files
    manifest: Optional[dict] = None  # when loaded from a slimlm artifact


def load_model(cfg: ModelConfig, device: torch.device, sha256: Optional[str] = None) -> LoadedModel:
    """Load weights and tokenizer for `cfg` onto `device`, in eval mode; `sha256`: the source's
    hash (source_sha256) when the caller has it, so that the weights are not hashed twice."""
    source = resolve_model(cfg)
    dtype = DTYPES[cfg.dtype]
    if source.kind == "artifact":
        if cfg.bnb is not None:
            raise SlimlmError(
                "model.bnb applies to an original checkpoint, not to a slimlm artifact; drop model.bnb"
            )
        artifact = load_artifact(source.path, device)
        # The artifact's source hash: its KL is measured against the model it was made from.
        return LoadedModel(
            artifact.model,
            artifact.tokenizer,
            source,
            artifact.manifest.get("source", {}).get("sha256"),
            artifact.manifest,
        )
    sha256 = sha256 or source_sha256(source)
    directory = checkpoint_directory(source, sha256) or source.id
    model, tokenizer = _from_pretrained(
        str(directory), dtype, cfg.revision, source, **bnb_arguments(cfg.bnb, dtype, device)
    )
    check_compressible(cfg.path, model.config.model_type)  # hub ids are only known once loaded
    split_experts(model)  # mixture-of-experts blocks: one Linear per expert projection
    if cfg.bnb is None:
        model = model.to(device)
    return LoadedModel(model.eval(), tokenizer, source, sha256)


def source_sha256(source: ModelSource) -> Optional[str]:
    """The hash of a source's weights (the GGUF file or the checkpoint's weight files): its
    provenance, and the key of its cached reference distributions."""
    if source.kind == "gguf":
        return sha256_file(source.path)
    if source.kind == "hf-dir":
        return checkpoint_sha256(source.path)
    return None


def checkpoint_directory(source: ModelSource, sha256: Optional[str]) -> Optional[Path]:
    """The local safetensors checkpoint a source's weights are read from (a GGUF file's
    converted cache, keyed by the file's `sha256`: hashed here when None); None for a hub id or
    an artifact."""
    if source.kind == "gguf":
        return gguf_checkpoint(source.path, sha256 or source_sha256(source))
    return source.path if source.kind == "hf-dir" else None


def bnb_arguments(bnb: Optional[str], dtype: torch.dtype, device: torch.device) -> dict:
    """from_pretrained arguments that quantize on load with bitsandbytes (the peer baselines).

    int8 is LLM.int8() (per-row absmax, outlier threshold 6.0); nf4 uses bitsandbytes' default
    block size of 64 with float32 absmax, computing in the model's dtype.
    """
    if bnb is None:
        return {}
    from transformers import BitsAndBytesConfig

    if bnb == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    return {"quantization_config": config, "device_map": str(device)}


def _from_pretrained(
    location: str, dtype: torch.dtype, revision: Optional[str], source: ModelSource, **kwargs: Any
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, revision=revision, **kwargs)
        model, info = AutoModelForCausalLM.from_pretrained(
            location, dtype=dtype, revision=revision, output_loading_info=True, **kwargs
        )
    except OSError as error:
        if source.kind == "hub":
            raise SlimlmError(
                f"could not fetch '{location}' from the Hugging Face hub ({str(error).splitlines()[0]}); "
                "without network, point model.path at a local checkpoint directory or .gguf file"
            ) from None
        raise SlimlmError(f"could not load the model at '{location}': {str(error).splitlines()[0]}") from None
    except Exception as error:  # safetensors and the quantizers raise their own kinds on damaged files
        raise SlimlmError(
            f"could not load the model at '{location}' ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'damaged'}); re-download or re-export it"
        ) from None
    # transformers fills missing tensors with random values and only warns: a damaged checkpoint
    # would then score like a broken model. A tied head is the one tensor allowed to be absent.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(info.get("missing_keys", [])) - tied)
    if missing:
        raise SlimlmError(
            f"the checkpoint at '{location}' lacks {len(missing)} tensors its "
            f"config needs (e.g. {missing[0]}); re-download or re-export it"
        )
    return model, tokenizer


def checkpoint_sha256(directory: Path) -> Optional[str]:
    """One hash over a checkpoint's weight files (names and bytes), for provenance."""
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    if not files:
        return None
    import hashlib

    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


# Part of a conversion's cache name: raised when conversion changes, so no earlier, different
# conversion is reused (2: slimlm/gguf_config.py's corrections).
GGUF_CONVERSION = "c2"


def gguf_config(gguf_path: Path) -> Any:
    """transformers' config of a GGUF file with what its GGUF reader leaves out read back
    (slimlm/gguf_config.py), and a padding id past the vocabulary dropped."""
    from transformers import AutoConfig

    from slimlm.gguf_config import config_corrections

    corrections = config_corrections(gguf_path)  # first: it refuses files transformers cannot read
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for key, value in corrections.items():
        setattr(config, key, value)
    if isinstance(config.pad_token_id, int) and config.pad_token_id >= config.vocab_size:
        config.pad_token_id = None
    return config


def gguf_checkpoint(gguf_path: Path, sha256: str) -> Path:
    """The cached safetensors checkpoint for a GGUF file, converting it the first time."""
    target = cache_dir() / "models" / f"{gguf_path.stem}-{sha256[:16]}-{GGUF_CONVERSION}"
    if (target / "slimlm_source.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            config = gguf_config(gguf_path)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, dtype=torch.float32, config=config, **kwargs
            )
        except Exception as error:  # transformers' GGUF reader raises many kinds on a file it cannot take
            raise SlimlmError(
                f"GGUF file '{gguf_path.name}' cannot be converted "
                f"({first_line(error)}); re-download or re-export it"
            ) from None
        # The weights are now plain float tensors; the GGUF quantization record no longer applies.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        provenance = {"gguf_file": gguf_path.name, "sha256": sha256, "dtype": "float32"}
        (staging / "slimlm_source.json").write_text(json.dumps(provenance, indent=2))
        if target.exists():  # a conversion interrupted before its marker was written
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
