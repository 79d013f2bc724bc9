"""The tokenizer part of a GGUF file, written as llama.cpp's own converter writes it.

llama.cpp runs one of two tokenizers, named by `tokenizer.ggml.model`:
  gpt2   byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM): tokens, merges, and `tokenizer.ggml.pre`,
         the pre-tokenizer (the regexes that split text before BPE). llama.cpp's converter names it
         by a hash of the tokenizer's ids for a fixed text: the hash captures the regexes, which
         tokenizer.json spells in many equivalent ways. We use the same text and hashes.
  llama  SentencePiece-style BPE with byte fallback (Llama 2, Mistral v0.1, Gemma, Phi-3): pieces with
         scores (llama.cpp merges the adjacent pair whose joined piece scores highest) and types.
         transformers keeps such tokenizers as tokenizer.json (a BPE with byte_fallback), so the
         scores come from its merge ranks: a piece made by an earlier merge scores higher.
Both get the special token ids, add_bos/add_eos and the chat template (gguf's SpecialVocab, as the
converter does), and the token list is padded to the embedding's rows with unused `[PADn]` entries.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

from slimlm.errors import SlimlmError

# llama.cpp's text for naming a pre-tokenizer (convert_hf_to_gguf.py, get_vocab_base_pre) and the hashes of
# the ids that the tokenizers of the families we export give for it.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) "
    "\U0001f636\u200d\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 "
    "\U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "\u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 "
    "?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= "
    "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 .. Qwen2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
# SentencePiece token types, as llama.cpp reads them (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class Vocabulary:
    """What llama.cpp's tokenizer keys hold: `model` is gpt2 or llama; `scores` only for llama."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    add_space_prefix: bool | None


def write_tokenizer(writer, tokenizer: Any, rows: int) -> None:
    """The `tokenizer.*` keys for a Hugging Face tokenizer, its token list padded to `rows` entries."""
    import gguf

    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        spec = _read_tokenizer_json(Path(directory))
        vocabulary = _vocabulary(tokenizer, spec, rows)
        writer.add_tokenizer_model(vocabulary.model)
        writer.add_tokenizer_pre(vocabulary.pre)
        writer.add_token_list(vocabulary.tokens)
        writer.add_token_types(vocabulary.types)
        if vocabulary.scores is not None:
            writer.add_token_scores(vocabulary.scores)
        if vocabulary.add_space_prefix is not None:
            writer.add_add_space_prefix(vocabulary.add_space_prefix)
        special = gguf.SpecialVocab(Path(directory), load_merges=vocabulary.model == "gpt2", n_vocab=rows)
        special.add_to_gguf(writer, quiet=True)
        if (
            "add_bos" not in special.add_special_token
        ):  # transformers 5 may leave it out of tokenizer_config.json
            writer.add_add_bos_token(_adds_bos(tokenizer))


def _read_tokenizer_json(directory: Path) -> dict:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise SlimlmError("GGUF export needs a fast (tokenizer.json) tokenizer; this one saves none")
    return json.loads(path.read_text(encoding="utf-8"))


def _vocabulary(tokenizer: Any, spec: dict, rows: int) -> Vocabulary:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise SlimlmError(
            "GGUF export writes BPE tokenizers (byte-level or "
            f"SentencePiece-style); this one is a {model.get('type')} tokenizer"
        )
    ids = tokenizer.get_vocab()
    if max(ids.values()) >= rows:
        raise SlimlmError(
            f"the tokenizer has ids up to {max(ids.values())} but the embedding only {rows} rows"
        )
    added = {token.content: token for token in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    sentencepiece = bool(model.get("byte_fallback"))
    ranks = _merge_ranks(model.get("merges") or []) if sentencepiece else {}
    tokens, types, scores = [f"[PAD{i}]" for i in range(rows)], [UNUSED] * rows, [-10000.0] * rows
    for text, index in ids.items():
        kind = _token_type(
            text,
            added.get(text),
            sentencepiece,
            model.get("unk_token") or getattr(tokenizer, "unk_token", None),
        )
        tokens[index] = text.replace("\u2581", " ") if kind == USER_DEFINED and sentencepiece else text
        types[index] = kind
        scores[index] = -float(ranks[text]) if text in ranks else 0.0
    if sentencepiece:
        return Vocabulary("llama", "default", tokens, types, scores, _adds_space_prefix(spec))
    return Vocabulary("gpt2", _pre_tokenizer(tokenizer, spec), tokens, types, None, None)


def _token_type(text: str, added, sentencepiece: bool, unknown: str | None) -> int:
    if sentencepiece and text == unknown:
        return UNKNOWN
    if added is not None:
        return CONTROL if added.special else USER_DEFINED
    if sentencepiece and BYTE_PIECE.fullmatch(text):
        return BYTE
    return NORMAL


def _merge_ranks(merges: list) -> dict[str, int]:
    """The rank of the first merge that makes each piece (tokenizer.json writes a merge as
    "a b" or [a, b])."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(left + right, rank + 1)
    return ranks


def _adds_space_prefix(spec: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text (Llama 2, Mistral, Phi-3) or not (Gemma)."""
    parts = [spec.get("normalizer"), spec.get("pre_tokenizer")]
    found: list[dict] = []
    while parts:
        part = parts.pop()
        if isinstance(part, dict):
            found.append(part)
            parts.extend(part.get("normalizers") or part.get("pretokenizers") or [])
    return any(
        part.get("type") == "Prepend"
        or (part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never")
        for part in found
    )


def _pre_tokenizer(tokenizer: Any, spec: dict) -> str:
    """llama.cpp's name for the byte-level BPE's pre-tokenizer: by llama.cpp's hash, else a
    plain GPT-2 ByteLevel."""
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[digest]
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # the GPT-2 regex, which llama.cpp's gpt-2 pre-tokenizer applies
    known = ", ".join(sorted(set(PRE_TOKENIZERS.values())))
    raise SlimlmError(
        "GGUF export does not know this tokenizer's pre-tokenizer "
        f"(hash {digest[:12]}); llama.cpp's known ones include {known}"
    )


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a").input_ids
    return bos is not None and len(ids) > 0 and ids[0] == bos
