import json

import pytest
import torch
from safetensors.torch import load_file

from slimlm import data
from slimlm.config import TextSourceConfig
from slimlm.data import load_text
from slimlm.errors import SlimlmError


def test_text_file_is_one_document_with_unix_newlines(tmp_path):
    path = tmp_path / "t.raw"
    path.write_bytes(b" = Title = \r\n line one\r\n\r\n line two\r\n")
    assert load_text(TextSourceConfig(path=str(path)), "eval_text") == " = Title = \n line one\n\n line two\n"


def test_jsonl_records_are_joined(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["first", "second"])))
    assert load_text(TextSourceConfig(path=str(path), format="jsonl"), "calibration") == "first\n\nsecond"


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """JSON writes U+2028 inside strings unescaped (ensure_ascii=False): only \\n ends a record."""
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in ["a\u2028b", "c\x85d"]),
        encoding="utf-8",
    )
    assert load_text(TextSourceConfig(path=str(path), format="jsonl"), "calibration") == "a\u2028b\n\nc\x85d"


def test_jsonl_without_the_field_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"body": "x"}))
    with pytest.raises(SlimlmError, match="no field 'text'"):
        load_text(TextSourceConfig(path=str(path), format="jsonl"), "calibration")


def test_missing_and_empty_files_are_refused(tmp_path):
    with pytest.raises(SlimlmError, match="not found"):
        load_text(TextSourceConfig(path=str(tmp_path / "nope.txt")), "eval_text")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(SlimlmError, match="no text"):
        load_text(TextSourceConfig(path=str(empty)), "eval_text")


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(SlimlmError, match="format"):
        load_text(TextSourceConfig(path=str(tmp_path), format="parquet"), "eval_text")


def test_bundled_demo_data_is_present():
    text = load_text(TextSourceConfig(path="pkg://slimlm/assets/wikitext-2-raw/wiki.test.raw"), "eval_text")
    assert text.startswith(" = Robert Boulter = \n") and "\r" not in text


def test_hub_data_set_offline_is_explained():
    with pytest.raises(SlimlmError, match="could not load hub data set 'Salesforce/wikitext'"):
        load_text(
            TextSourceConfig(path="Salesforce/wikitext", format="hub", subset="wikitext-2-raw-v1"),
            "eval_text",
        )


def test_token_ids_are_cached_per_text_and_tokenizer(tiny_tokenizer, tmp_path, monkeypatch):
    """The second tokenization of the same text by the same tokenizer is read from the cache; a
    different text, or a damaged cache entry, is tokenized afresh."""
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path))
    calls = []
    real = data.tokenize_text
    monkeypatch.setattr(data, "tokenize_text", lambda tok, text: calls.append(text) or real(tok, text))
    text = "the cat sat on the mat. " * 50
    first = data.tokenize_text_cached(tiny_tokenizer, text)
    assert torch.equal(first, real(tiny_tokenizer, text)) and len(calls) == 1
    assert torch.equal(data.tokenize_text_cached(tiny_tokenizer, text), first) and len(calls) == 1
    data.tokenize_text_cached(tiny_tokenizer, text + "!")
    assert len(calls) == 2
    (entry,) = [p for p in (tmp_path / "tokens").iterdir() if torch.equal(load_file(p)["ids"], first)]
    entry.write_bytes(b"not a safetensors file")
    assert torch.equal(data.tokenize_text_cached(tiny_tokenizer, text), first) and len(calls) == 3
    assert torch.equal(load_file(entry)["ids"], first)  # the damaged entry was replaced


def test_a_tokenizer_without_a_definition_to_hash_is_not_cached(tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path))

    class Slow:
        def __call__(self, text, add_special_tokens):
            return tiny_tokenizer(text, add_special_tokens=add_special_tokens)

    ids = data.tokenize_text_cached(Slow(), "a few words")
    assert torch.equal(ids, data.tokenize_text(tiny_tokenizer, "a few words"))
    assert not (tmp_path / "tokens").exists()
