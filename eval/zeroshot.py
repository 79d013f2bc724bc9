"""Zero-shot accuracy by log-likelihood, scored the way lm-evaluation-harness scores it.

A task is a YAML file (the bundled ones live in `slimlm.eval.tasks`) that says how to turn each
data row into a context and one or more continuations. Each (context, continuation) pair is
scored by the summed log-probability of the continuation's tokens given the context:

- `multiple_choice`: acc = the answer has the highest log-likelihood; acc_norm = the highest
  log-likelihood per UTF-8 byte of the choice text (the harness divides by the same string's
  length in characters, which is the same number for ASCII text).
- `last_word` (LAMBADA): the context is the text up to its last space and the continuation the
  space plus the last word; acc = every continuation token is the greedy choice, ppl = exp of
  minus the mean per-example log-likelihood.
- `fill_blank` (WinoGrande-style, the harness's partial evaluation): the text has a blank
  marker; each choice's context is the text up to the blank with that choice in its place, and
  the continuation, shared by all choices, is a space and the rest of the text after the blank.
  acc = the answer's context makes the continuation most likely.

Tokenization follows the harness: trailing whitespace of the context moves into the
continuation, context + continuation is encoded as one string and split at the context's token
count, and no special token is added unless the tokenizer adds a BOS on its own.

For speed an item is one sequence: its context once, then every continuation, each masked to
see only the context and itself and positioned right after the context, so the scores equal
scoring each pair alone while the context is run once. Items are sorted by length and batched
with right padding, and the LM head runs only on the positions whose log-probs are needed.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import re
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    List,
    Optional,
    Sequence,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import torch
import yaml
from tqdm import tqdm

from slimlm.architecture import family_of, model_type
from slimlm.errors import SlimlmError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

BUNDLED_TASKS = ("lambada", "arc_easy", "piqa", "hellaswag")
KINDS = ("multiple_choice", "last_word", "fill_blank")
CHOICE_FIELDS = (
    "choices",
    "continuation",
    "answer_field",
    "answer_labels",
    "answer_file",
    "answer_style",
)  # not for last_word
ANSWER_STYLES = ("index", "number", "letter")  # an answer as 0, 1, ...; as 1, 2, ...; as A, B, ...
DATA_ROOT_ENV = "SLIMLM_DATA_DIR"
DEFAULT_DATA_ROOT = "../shared/data"
DATA_HINT = (
    "task data is read from beside the task file, else from the data root: "
    f"${DATA_ROOT_ENV}, default {DEFAULT_DATA_ROOT} (see its DATA.md)"
)
HEAD_CHUNK = 1024  # LM-head rows per matmul: bounds the (rows x vocab) logits in memory
TEMPLATE_FIELD = re.compile(r"\{([A-Za-z_][\w.]*)\}")


@dataclass(frozen=True)
class TaskSpec:
    """A task as its YAML file states it; paths are relative to the data root."""

    name: str
    kind: str  # multiple_choice | last_word | fill_blank
    data: str  # a jsonl file, one row per item
    context: str  # template over row fields, e.g. "Question: {question}\nAnswer:"; last_word: the whole text
    choices: Optional[Union[str, List[str]]] = None  # a field holding a list, or a list of templates
    continuation: str = " {choice}"  # template over row fields and {choice}
    answer_field: Optional[str] = None  # field holding the answer: an index, or a label (see answer_labels)
    answer_labels: Optional[str] = None  # field holding the label list that answers are looked up in
    answer_file: Optional[str] = None  # or: a file with one answer per line, aligned with the rows
    answer_style: str = (
        "index"  # how answers count the choices: index (0, 1, ...), number (1, 2, ...) or letter (A, B, ...)
    )
    blank: str = "_"  # fill_blank: the marker where each choice goes; the text is split at its first one
    preprocess: Optional[str] = None  # a named row transform applied first (see PREPROCESSORS)


@dataclass(frozen=True)
class Item:
    """One question: a context, its continuations and the index of the right one."""

    context: str
    choices: tuple[str, ...]  # the choice texts; acc_norm divides by their UTF-8 byte lengths
    continuations: tuple[str, ...]  # what is scored after the context, one per choice
    answer: int
    choice_contexts: tuple[str, ...] = ()  # fill_blank: each choice's own context; `context` is then unused

    def scored_pairs(self) -> list[Item]:
        """What is scored: the item itself (one context, its continuations), or for per-choice
        contexts one single-continuation item per choice."""
        if not self.choice_contexts:
            return [self]
        return [
            Item(context, (choice,), (continuation,), 0)
            for context, choice, continuation in zip(self.choice_contexts, self.choices, self.continuations)
        ]


@dataclass(frozen=True)
class Task:
    spec: TaskSpec
    source: str  # the YAML file, for messages
    items: tuple[Item, ...]


@dataclass(frozen=True)
class TaskResult:
    task: str
    n: int
    acc: float
    acc_stderr: float
    acc_norm: Optional[float] = None  # multiple_choice only
    acc_norm_stderr: Optional[float] = None
    ppl: Optional[float] = None  # last_word only
    seconds: float = 0.0  # wall time of the scoring, tokenization included

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- preprocessing


def _clean_hellaswag(text: str) -> str:
    """The harness's HellaSwag text cleaning: WikiHow rows carry [title]/[step] markup."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag_row(row: dict) -> dict:
    """The harness's HellaSwag process_docs: adds a cleaned `query` and cleaned `choices`."""
    context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _clean_hellaswag(row["activity_label"] + ": " + context)
    return {**row, "query": query, "choices": [_clean_hellaswag(ending) for ending in row["endings"]]}


PREPROCESSORS: dict[str, Callable[[dict], dict]] = {"hellaswag": _hellaswag_row}


# ---------------------------------------------------------------- task files


def default_data_root(given: Optional[Union[str, Path]] = None) -> Path:
    """`given` when there is one, else $SLIMLM_DATA_DIR, else DEFAULT_DATA_ROOT."""
    return (
        Path(given)
        if given is not None
        else Path(os.environ.get(DATA_ROOT_ENV, DEFAULT_DATA_ROOT)).expanduser()
    )


def load_task(name_or_path: str, data_root: Optional[Union[str, Path]] = None) -> Task:
    """A bundled task by name (see BUNDLED_TASKS) or any task YAML by path, with its data read:
    paths in a task file are relative to the data root, or to the file's own folder where the
    data file is there."""
    file = _task_file(name_or_path)
    spec, keys = _read_spec(file)
    _check_spec(spec, keys, str(file))
    if spec.name in BUNDLED_TASKS and name_or_path != spec.name:
        raise SlimlmError(
            f"task file '{file}' is named '{spec.name}', as a bundled task is, and results are "
            f"reported by name; give it another name: (or run the bundled task as '{spec.name}')"
        )
    root = default_data_root(data_root)
    if isinstance(file, Path) and (file.parent / spec.data).is_file():  # a task file's own data beside it
        root = file.parent
    rows = _read_rows(root, spec)
    answers = _read_answer_file(root, spec, len(rows)) if spec.answer_file else None
    items = tuple(
        _make_item(
            spec, row, answers[i] if answers else None, f"task '{spec.name}', row {i + 1} of {spec.data}"
        )
        for i, row in enumerate(rows)
    )
    return Task(spec=spec, source=str(file), items=items)


def _task_file(name_or_path: str) -> Traversable:
    """A path when it looks like one (a .yaml suffix or a separator), else a bundled task."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path or os.sep in name_or_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise SlimlmError(
                f"task file '{name_or_path}' not found; give the path of "
                f"a task YAML or a bundled task: {', '.join(BUNDLED_TASKS)}"
            )
        return path
    if name_or_path not in BUNDLED_TASKS:
        raise SlimlmError(
            f"unknown task '{name_or_path}'; bundled tasks: "
            f"{', '.join(BUNDLED_TASKS)} (or give the path of a task YAML)"
        )
    return importlib.resources.files("slimlm.eval.tasks").joinpath(f"{name_or_path}.yaml")


def _read_spec(file: Traversable) -> tuple[TaskSpec, set[str]]:
    """Parse and type-check a task YAML; returns the spec and the keys the file set."""
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise SlimlmError(f"task file '{file}' is not valid YAML ({error}); fix its syntax") from None
    if not isinstance(raw, dict):
        raise SlimlmError(
            f"task file '{file}' must be a mapping of fields, e.g. name: ..., kind: ..., data: ..."
        )
    hints = get_type_hints(TaskSpec)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise SlimlmError(
            f"task file '{file}': unknown field '{unknown[0]}'; the fields are {', '.join(hints)}"
        )
    for spec_field in fields(TaskSpec):
        if spec_field.name not in raw and spec_field.default is MISSING:
            raise SlimlmError(f"task file '{file}': field '{spec_field.name}' is required")
    for key, value in raw.items():
        if not _has_type(value, hints[key]):
            raise SlimlmError(
                f"task file '{file}': field '{key}' must be "
                f"{_describe(hints[key])}, not {type(value).__name__} ({value!r})"
            )
    return TaskSpec(**raw), set(raw)


def _has_type(value: Any, hint: Any) -> bool:
    origin = get_origin(hint)
    if origin is Union:
        return any(_has_type(value, option) for option in get_args(hint))
    if origin in (list, List):
        return isinstance(value, list) and all(_has_type(v, get_args(hint)[0]) for v in value)
    return value is None if hint is type(None) else isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Union:
        return " or ".join(_describe(option) for option in get_args(hint))
    if origin in (list, List):
        return f"a list of {_describe(get_args(hint)[0])}"
    return "null" if hint is type(None) else hint.__name__


def _check_spec(spec: TaskSpec, keys: set[str], source: str) -> None:
    """What types cannot say: known kind and preprocessor, and the fields each kind needs."""
    if spec.kind not in KINDS:
        raise SlimlmError(
            f"task file '{source}': kind '{spec.kind}' is unknown; use one of {', '.join(KINDS)}"
        )
    if spec.preprocess is not None and spec.preprocess not in PREPROCESSORS:
        raise SlimlmError(
            f"task file '{source}': preprocess '{spec.preprocess}' "
            f"is unknown; use one of {', '.join(PREPROCESSORS)}"
        )
    if spec.kind == "last_word":
        extra = [key for key in (*CHOICE_FIELDS, "blank") if key in keys]
        if extra:
            raise SlimlmError(
                f"task file '{source}': field '{extra[0]}' is for tasks "
                "with choices only; last_word scores the text's last word"
            )
        return
    if spec.kind == "fill_blank" and "continuation" in keys:
        raise SlimlmError(
            f"task file '{source}': fill_blank's continuation is "
            "the text after the blank; drop the field 'continuation'"
        )
    if spec.kind == "multiple_choice" and "blank" in keys:
        raise SlimlmError(f"task file '{source}': field 'blank' is for kind fill_blank only")
    if spec.answer_style not in ANSWER_STYLES:
        raise SlimlmError(
            f"task file '{source}': answer_style '{spec.answer_style}' "
            f"is unknown; use one of {', '.join(ANSWER_STYLES)}"
        )
    if not spec.blank:
        raise SlimlmError(f"task file '{source}': field 'blank' must be a non-empty marker, e.g. '_'")
    if spec.choices is None:
        raise SlimlmError(
            f"task file '{source}': field 'choices' is required for "
            f"kind {spec.kind} (a list field, or a list of templates)"
        )
    if (spec.answer_field is None) == (spec.answer_file is None):
        raise SlimlmError(
            f"task file '{source}': give exactly one of the fields 'answer_field' and 'answer_file'"
        )


# ---------------------------------------------------------------- data


def _data_path(root: Path, relative: str, task: str) -> Path:
    path = root / relative
    if not path.is_file():
        raise SlimlmError(f"task '{task}': data file '{path}' not found; {DATA_HINT}, or pass data_root")
    return path


def _read_rows(root: Path, spec: TaskSpec) -> list[dict]:
    path = _data_path(root, spec.data, spec.name)
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SlimlmError(
                    f"task '{spec.name}': data file '{path}' line "
                    f"{number} is not JSON ({error.msg}); {DATA_HINT}"
                ) from None
            if not isinstance(row, dict):
                raise SlimlmError(
                    f"task '{spec.name}': data file '{path}' line {number} is not a JSON object; {DATA_HINT}"
                )
            rows.append(row)
    if not rows:
        raise SlimlmError(f"task '{spec.name}': data file '{path}' has no rows; {DATA_HINT}")
    return rows


def _read_answer_file(root: Path, spec: TaskSpec, n_rows: int) -> list[str]:
    path = _data_path(root, spec.answer_file, spec.name)
    answers = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(answers) != n_rows:
        raise SlimlmError(
            f"task '{spec.name}': answer file '{path}' has {len(answers)} "
            f"answers for {n_rows} rows of '{spec.data}'; {DATA_HINT}"
        )
    return answers


def _lookup(row: dict, dotted: str, where: str) -> Any:
    """A row field by dotted name (`choices.text`): nested objects are common in these data sets."""
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise SlimlmError(f"{where}: no field '{dotted}'; the row's fields are {', '.join(row)}")
        value = value[key]
    return value


def _render(template: str, row: dict, where: str) -> str:
    return TEMPLATE_FIELD.sub(lambda match: str(_lookup(row, match.group(1), where)), template)


def _make_item(spec: TaskSpec, row: dict, file_answer: Optional[str], where: str) -> Item:
    if spec.preprocess is not None:
        try:
            row = PREPROCESSORS[spec.preprocess](row)
        except KeyError as missing:
            raise SlimlmError(
                f"{where}: preprocess '{spec.preprocess}' needs field "
                f"{missing}; the row's fields are {', '.join(row)}"
            ) from None
    text = _render(spec.context, row, where)
    if spec.kind == "last_word":
        context, _, word = text.rpartition(" ")
        return Item(context=context, choices=(word,), continuations=(" " + word,), answer=0)
    choices = _choices(spec, row, where)
    answer = _lookup(row, spec.answer_field, where) if file_answer is None else file_answer
    index = _answer_index(spec, row, answer, len(choices), where)
    if spec.kind == "fill_blank":
        before, marker, after = text.partition(spec.blank)
        if not marker:
            raise SlimlmError(f"{where}: the text has no blank marker {spec.blank!r}: {text!r}")
        rest = " " + after.strip()
        return Item(
            context="",
            choices=choices,
            continuations=(rest,) * len(choices),
            answer=index,
            choice_contexts=tuple(before + choice for choice in choices),
        )
    continuations = tuple(_render(spec.continuation, {**row, "choice": choice}, where) for choice in choices)
    return Item(context=text, choices=choices, continuations=continuations, answer=index)


def _choices(spec: TaskSpec, row: dict, where: str) -> tuple[str, ...]:
    if isinstance(spec.choices, str):
        choices = _lookup(row, spec.choices, where)
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise SlimlmError(f"{where}: field '{spec.choices}' must hold a list of strings (the choices)")
    else:
        choices = [_render(template, row, where) for template in spec.choices]
    if len(choices) < 2 or not all(choices):
        raise SlimlmError(f"{where}: needs at least two non-empty choices, got {choices!r}")
    return tuple(choices)


def _answer_index(spec: TaskSpec, row: dict, answer: Any, n_choices: int, where: str) -> int:
    """The answer as a choice index: looked up in a label list, or read in the task's answer_style."""
    text = str(int(answer)) if isinstance(answer, bool) else str(answer).strip()
    if spec.answer_labels is not None:
        labels = [str(label) for label in _lookup(row, spec.answer_labels, where)]
        if str(answer) not in labels:
            raise SlimlmError(
                f"{where}: answer {answer!r} is not among the labels in '{spec.answer_labels}' {labels}"
            )
        index = labels.index(str(answer))
    elif spec.answer_style == "letter" and len(text) == 1 and text.isalpha():
        index = ord(text.upper()) - ord("A")
    elif spec.answer_style != "letter" and isinstance(answer, (int, str)) and text.isdigit():
        index = int(text) - (1 if spec.answer_style == "number" else 0)
    else:
        raise SlimlmError(
            f"{where}: answer {answer!r} is not a choice {spec.answer_style}; set answer_style "
            "(index, number, letter) or answer_labels to the field listing the labels"
        )
    if not 0 <= index < n_choices:
        raise SlimlmError(f"{where}: answer index {index} is out of range for {n_choices} choices")
    return index


# ---------------------------------------------------------------- tokenization


@dataclass(frozen=True)
class Packed:
    """One item as one sequence: the context once, then each continuation but its last token."""

    input_ids: list[int]
    position_ids: list[int]  # each continuation restarts right after the context
    segments: list[int]  # 0: context, j + 1: continuation j (the attention mask is built from these)
    score_at: list[int]  # the position whose output predicts each target token
    targets: list[int]  # every continuation's tokens, one after the other
    spans: list[tuple[int, int]]  # each continuation's slice of targets


def _prefix_token(tokenizer) -> list[int]:
    """The BOS the tokenizer adds on its own, which the harness keeps; else nothing."""
    bos = tokenizer.bos_token_id
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return [bos] if bos is not None and with_special[: len(plain) + 1] == [bos] + plain else []


def _encode(tokenizer, items: Sequence[Item], where: str) -> list[Packed]:
    """Harness-style pairs: the context's trailing whitespace moves into each continuation."""
    prefix = _prefix_token(tokenizer)
    contexts = [item.context.rstrip() for item in items]
    wholes = [item.context + continuation for item in items for continuation in item.continuations]
    context_ids = tokenizer(contexts, add_special_tokens=False)["input_ids"]
    whole_ids = iter(tokenizer(wholes, add_special_tokens=False)["input_ids"])
    packed = []
    for number, (item, context) in enumerate(zip(items, context_ids), 1):
        continuations = [next(whole_ids)[len(context) :] for _ in item.continuations]
        if not all(continuations):
            raise SlimlmError(
                f"{where}: item {number}: a continuation has no tokens of its own (it merges "
                "into the context's last token); change the task's continuation template"
            )
        packed.append(_pack(prefix + context or _empty_context(tokenizer), continuations))
    return packed


def _empty_context(tokenizer) -> list[int]:
    """An empty context is conditioned on BOS (else EOS), as the harness does."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise SlimlmError(
            "an item has an empty context and the tokenizer "
            "has neither a BOS nor an EOS token to condition on"
        )
    return [token]


def _pack(context: list[int], continuations: list[list[int]]) -> Packed:
    ids, positions, segments = list(context), list(range(len(context))), [0] * len(context)
    score_at: list[int] = []
    targets: list[int] = []
    spans = []
    for number, tokens in enumerate(continuations, 1):
        fed = tokens[:-1]  # the last token is only predicted, never an input
        score_at += [len(context) - 1, *range(len(ids), len(ids) + len(fed))]
        spans.append((len(targets), len(targets) + len(tokens)))
        targets += tokens
        ids += fed
        positions += range(len(context), len(context) + len(fed))
        segments += [number] * len(fed)
    return Packed(ids, positions, segments, score_at, targets, spans)


# ---------------------------------------------------------------- scoring


def _collate(batch: list[Packed], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids and positions, and an additive 4D mask: causal, and a continuation
    sees only the context and itself. Padding (segment -1) sees context and padding, never NaN."""
    width = max(len(p.input_ids) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    positions = torch.zeros(len(batch), width, dtype=torch.long)
    segments = torch.full((len(batch), width), -1, dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, : len(p.input_ids)] = torch.tensor(p.input_ids)
        positions[row, : len(p.input_ids)] = torch.tensor(p.position_ids)
        segments[row, : len(p.input_ids)] = torch.tensor(p.segments)
    keys, queries = segments[:, None, :], segments[:, :, None]
    allowed = torch.ones(width, width, dtype=torch.bool).tril() & ((keys == queries) | (keys == 0))
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return ids, positions, mask[:, None]


def _body_and_head(model) -> Optional[tuple[Any, Any]]:
    """Families whose logits are lm_head(hidden) let the head run on the needed positions only;
    other models may scale or cap logits and go through their full forward."""
    family = family_of(model_type(model))
    if family is not None and family.plain_logits and hasattr(model, "model") and hasattr(model, "lm_head"):
        return model.model, model.lm_head
    return None


def _token_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target, and whether it is the greedy (argmax) token."""
    logits = logits.float()
    log_probs = logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(-1)
    return log_probs, logits.argmax(-1) == targets


def _score_positions(model, batch: list[Packed]) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    ids, positions, mask = (t.to(device) for t in _collate(batch, model.dtype))
    rows = torch.tensor([row for row, p in enumerate(batch) for _ in p.targets], device=device)
    cols = torch.tensor([col for p in batch for col in p.score_at], device=device)
    targets = torch.tensor([t for p in batch for t in p.targets], device=device)
    inputs = dict(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False)
    split = _body_and_head(model)
    if split is None:
        return _token_scores(model(**inputs).logits[rows, cols], targets)
    body, head = split
    hidden = body(**inputs).last_hidden_state[rows, cols]
    scores = [_token_scores(head(h), t) for h, t in zip(hidden.split(HEAD_CHUNK), targets.split(HEAD_CHUNK))]
    return torch.cat([s[0] for s in scores]), torch.cat([s[1] for s in scores])


def _score_batch(model, batch: list[Packed]) -> list[list[tuple[float, bool]]]:
    """Per item, per continuation: (summed log-likelihood, every token greedy)."""
    log_probs, greedy = (t.tolist() for t in _score_positions(model, batch))
    results, offset = [], 0
    for p in batch:
        results.append(
            [
                (sum(log_probs[offset + a : offset + b]), all(greedy[offset + a : offset + b]))
                for a, b in p.spans
            ]
        )
        offset += len(p.targets)
    return results


@torch.inference_mode()
def _score(model, packed: list[Packed], batch_size: int, desc: str) -> list[list[tuple[float, bool]]]:
    """Longest first, so padding stays small and an out-of-memory shows up in the first batch."""
    order = sorted(range(len(packed)), key=lambda i: -len(packed[i].input_ids))
    results: list = [None] * len(packed)
    with tqdm(total=len(packed), desc=desc, unit="item") as progress:
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            for index, scores in zip(chosen, _score_batch(model, [packed[i] for i in chosen])):
                results[index] = scores
            progress.update(len(chosen))
    return results


def score_items(
    model, tokenizer, items: Sequence[Item], batch_size: int = 16, desc: str = "zero-shot"
) -> list[list[tuple[float, bool]]]:
    """Per item, per continuation: (summed log-likelihood of its tokens, every token greedy).

    `batch_size` items go through the model at once; the results do not depend on it."""
    if batch_size < 1:
        raise SlimlmError(f"batch_size={batch_size} must be at least 1")
    parts = [item.scored_pairs() for item in items]
    scores = iter(
        _score(model, _encode(tokenizer, [pair for pairs in parts for pair in pairs], desc), batch_size, desc)
    )
    return [[score for _ in pairs for score in next(scores)] for pairs in parts]


# ---------------------------------------------------------------- metrics


def _stderr(hits: list[bool]) -> float:
    """Standard error of a mean of 0/1 values, with the sample variance as the harness uses."""
    if len(hits) < 2:
        return math.nan
    p = sum(hits) / len(hits)
    return math.sqrt(p * (1 - p) / (len(hits) - 1))


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # first of ties, like numpy


def _metrics(task: Task, items: Sequence[Item], scores: list[list[tuple[float, bool]]]) -> dict:
    if task.spec.kind == "last_word":
        hits = [greedy for ((_, greedy),) in scores]
        mean_ll = sum(ll for ((ll, _),) in scores) / len(scores)
        return dict(acc=sum(hits) / len(hits), acc_stderr=_stderr(hits), ppl=math.exp(-mean_ll))
    if task.spec.kind == "fill_blank":  # one shared continuation: acc only, as the harness reports
        hits = [
            _argmax([ll for ll, _ in item_scores]) == item.answer for item, item_scores in zip(items, scores)
        ]
        return dict(acc=sum(hits) / len(hits), acc_stderr=_stderr(hits))
    hits, norm_hits = [], []
    for item, item_scores in zip(items, scores):
        lls = [ll for ll, _ in item_scores]
        hits.append(_argmax(lls) == item.answer)
        norm_hits.append(
            _argmax([ll / len(c.encode("utf-8")) for ll, c in zip(lls, item.choices)]) == item.answer
        )
    return dict(
        acc=sum(hits) / len(hits),
        acc_stderr=_stderr(hits),
        acc_norm=sum(norm_hits) / len(norm_hits),
        acc_norm_stderr=_stderr(norm_hits),
    )


def evaluate_task(
    model, tokenizer, task: Task, limit: Optional[int] = None, batch_size: int = 16
) -> TaskResult:
    """Score the task's first `limit` items (all when None); `batch_size` items per forward pass."""
    if limit is not None and limit < 1:
        raise SlimlmError(f"limit={limit} must be at least 1 (or None for the whole task)")
    started = time.perf_counter()
    items = task.items[:limit]
    scores = score_items(model, tokenizer, items, batch_size, desc=task.spec.name)
    return TaskResult(
        task=task.spec.name,
        n=len(items),
        seconds=round(time.perf_counter() - started, 3),
        **_metrics(task, items, scores),
    )
