"""The `distill` stage: train the run's current model (the student: pruned, quantized, or any
HF causal LM given as `student`) to match a teacher (by default the run's original model)
on data.calibration's text (the Gutenberg corpus with data=shared).

`loss: ce` trains on the text alone (plain fine-tuning, the baseline distillation is measured
against). The teacher signal is offline by default: its top-k log-probs are computed once and
cached (`top_k: null` runs it online, which hidden-state and on-policy losses need). Training
and checkpoints live in <run dir>/distill/; rerunning the same recipe in the same run directory
resumes from the newest checkpoint.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import torch
from omegaconf import OmegaConf

from slimlm.architecture import decoder_blocks
from slimlm.compress.quantize import calibration_token_ids
from slimlm.data import check_text_source, describe_calibration
from slimlm.distill.data import BatchOrder, Windows, cut_windows
from slimlm.distill.draft import draft_report
from slimlm.distill.losses import LOSSES, HiddenProjector
from slimlm.distill.qat import freeze_quantized, replace_quantized
from slimlm.distill.teacher import OnlineTeacher, check_same_vocabulary, offline_teacher
from slimlm.distill.train import Trainer, TrainSettings
from slimlm.errors import ConfigError, SlimlmError
from slimlm.models import LoadedModel, load_model
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantEmbedding, QuantLinear, set_submodule

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class DistillParams:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd | tvd | skew_kl | ce (no teacher)
    temperature: float = 1.0
    beta: Optional[float] = None  # JSD's beta (default 0.5), skew KL's alpha (default 0.1, as DistiLLM)
    ce_weight: float = 0.0  # share of plain cross-entropy mixed into the loss
    hidden_weight: float = 0.0  # weight of the hidden-state loss (online teacher only)
    hidden_loss: str = "mse"  # mse | cosine
    teacher: Optional[str] = None  # a model path or hub id; None: the run's original model
    student: Optional[str] = None  # a model to train instead of the run's current one (same tokenizer)
    top_k: Optional[int] = 64  # offline teacher: its top-k log-probs cached once; None: online teacher
    on_policy_fraction: float = 0.0  # GKD: share of micro-batches that are the student's own samples
    tokens: int = 200_000  # training budget in tokens (sets the number of steps)
    seq_len: int = 256
    batch_size: int = 8  # per process and micro-batch
    accumulation: int = 1
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    max_grad_norm: float = 1.0
    eval_every: int = 25  # optimizer steps between held-out perplexity checks
    eval_windows: int = 8  # held-out windows (the end of the training text)
    checkpoint_every: int = 25
    seed: int = 0
    # The student as a speculative-decoding draft for the teacher, measured before and after
    # training on this many held-out windows (their first 32 tokens as prompts); 0: not measured.
    draft_prompts: int = 0
    draft_new_tokens: int = 48
    # LoRA (peft): adapters of this rank on the frozen student (quantized layers included).
    lora_rank: Optional[int] = None
    lora_alpha: float = 16.0
    lora_targets: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # End-to-end quantization-aware training: only the quantized decoder layers' scales learn,
    # their codes stay (distill/qat.py); after a `reconstruct` stage, EfficientQAT's second phase.
    quant_scales: bool = False

    def __post_init__(self) -> None:
        if self.loss not in (*LOSSES, "ce"):
            raise ConfigError(
                f"distill.loss='{self.loss}' is unknown; choose one of {', '.join((*LOSSES, 'ce'))}"
            )
        if self.hidden_loss not in ("mse", "cosine"):
            raise ConfigError(f"distill.hidden_loss='{self.hidden_loss}' is unknown; choose mse or cosine")
        if self.temperature <= 0 or not 0 <= self.ce_weight <= 1 or self.hidden_weight < 0:
            raise ConfigError(
                "distill: temperature must be positive, ce_weight within [0, 1], hidden_weight at least 0"
            )
        if self.beta is not None and not (0 < self.beta < 1 if self.loss == "jsd" else 0 <= self.beta < 1):
            raise ConfigError(
                f"distill.beta={self.beta}: JSD needs 0 < beta < 1 and skew "
                "KL 0 <= alpha < 1 (at the ends the student gets no gradient)"
            )
        if not 0 <= self.on_policy_fraction <= 1:
            raise ConfigError(f"distill.on_policy_fraction={self.on_policy_fraction} must lie within [0, 1]")
        needs_online = self.on_policy_fraction > 0 or self.hidden_weight > 0
        if needs_online and self.top_k is not None:
            raise ConfigError(
                "distill: on-policy samples and hidden-state losses "
                "need the teacher online; set distill.top_k: null"
            )
        if self.loss == "ce" and (needs_online or self.ce_weight):
            raise ConfigError(
                "distill.loss=ce is plain fine-tuning without a teacher: "
                "drop ce_weight, hidden_weight and on_policy_fraction"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(
                f"distill.top_k={self.top_k} must be at least 1 (or null for an online teacher)"
            )
        if (
            min(self.seq_len, self.batch_size, self.accumulation, self.eval_windows, self.checkpoint_every)
            < 1
            or self.seq_len < 2
        ):
            raise ConfigError(
                "distill: seq_len (at least 2), batch_size, accumulation, "
                "eval_windows and checkpoint_every must be positive"
            )
        if self.tokens < self.seq_len * self.batch_size * self.accumulation:
            raise ConfigError(
                f"distill.tokens={self.tokens} is less than one optimizer step "
                f"({self.seq_len * self.batch_size * self.accumulation} tokens)"
            )
        if not 0 < self.lr < math.inf or not 0 <= self.warmup_fraction < 1:
            raise ConfigError(
                f"distill: lr={self.lr} must be a positive number and "
                f"warmup_fraction={self.warmup_fraction} within [0, 1)"
            )
        if (
            not 0 <= self.draft_prompts <= self.eval_windows
            or self.draft_new_tokens < 1
            or (self.draft_prompts and self.seq_len < 33)
        ):
            raise ConfigError(
                f"distill.draft_prompts={self.draft_prompts} must lie within [0, "
                f"eval_windows={self.eval_windows}] (prompts come from the held-out windows, "
                "which need seq_len above 32) and draft_new_tokens be at least 1"
            )
        if self.quant_scales and self.lora_rank is not None:
            raise ConfigError(
                "distill.quant_scales trains the quantized layers' scales and lora_rank an adapter "
                "on frozen layers: choose one"
            )
        if self.lora_rank is not None and (self.lora_rank < 1 or not self.lora_targets):
            raise ConfigError(
                "distill.lora_rank must be at least 1 and lora_targets name at least one module"
            )


def loss_beta(params: DistillParams) -> float:
    return params.beta if params.beta is not None else (0.1 if params.loss == "skew_kl" else 0.5)


def run(state: RunState, params: DistillParams) -> None:
    """Train the current model (or `student`) against the teacher; the trained model becomes the
    current one, and the report gains a distillation section."""
    started = time.perf_counter()
    if state.sections.get("sparsity"):
        raise SlimlmError(
            "the model was sparsified: training would fill its zeros again; put the "
            "distill stage before sparsify (prune, distill, then sparsify or quantize)"
        )
    # each distill stage of a recipe trains in its own directory
    index = len(state.sections.get("distillation", [])) + 1
    out_dir = state.run_dir / ("distill" if index == 1 else f"distill-{index}")
    accelerator = make_accelerator(state, params, out_dir)
    prepare_student(state, params)
    teacher = load_teacher(state, params)
    with accelerator.main_process_first():  # the main process samples or tokenizes into the cache first
        token_ids = calibration_token_ids(state)
    windows = cut_windows(token_ids, params.seq_len, params.eval_windows, params.batch_size)
    order = BatchOrder(
        windows=windows.train.shape[0],
        batch_size=params.batch_size,
        accumulation=params.accumulation,
        world=accelerator.num_processes,
        seed=params.seed,
    )
    steps = optimizer_steps(params, accelerator.num_processes)
    section = section_header(params, steps, accelerator.num_processes)
    section["data"] = describe_calibration(state.cfg.data)
    prompts = [window[:32].tolist() for window in windows.held_out[: params.draft_prompts]]
    draft_teacher = teacher.model if prompts else None
    if prompts:
        section["draft_before"] = draft_report(
            draft_teacher, state.model, state.tokenizer, prompts, params.draft_new_tokens
        )
    signal = None
    if params.loss != "ce" and params.top_k is not None:
        signal = cached_teacher_signal(state, params, teacher, accelerator, windows, order, steps, section)
        teacher = None  # never runs again (unless it judges drafts): free its memory for training
        gc.collect()
    elif params.loss != "ce":
        signal = OnlineTeacher(teacher.model)
        section["teacher_signal"] = "online"
    student = trainable_student(state.model, params)
    projector = hidden_projector(params, student, teacher, state.device)
    settings = train_settings(params, steps)
    fingerprint = run_fingerprint(state, index, accelerator.num_processes)
    trainer = Trainer(student, signal, windows, order, settings, out_dir, fingerprint, accelerator, projector)
    result = trainer.run()
    # later stages run in the model's own precision
    trained = accelerator.unwrap_model(trainer.student, keep_fp32_wrapper=False)
    state.model = finished_student(trained, params).eval()
    if prompts:
        section["draft_after"] = draft_report(
            draft_teacher, state.model, state.tokenizer, prompts, params.draft_new_tokens
        )
    accelerator.end_training()
    del trainer, signal, teacher, draft_teacher
    gc.collect()
    state.mark_changed(f"distilled ({params.loss}, {section['tokens']:,} tokens)")
    section.update(
        {
            "resumed_from_step": result.resumed_from,
            "history": result.history,
            "evals": result.evals,
            "train_seconds": round(result.seconds, 1),
            "seconds": round(time.perf_counter() - started, 1),
            "settings": asdict(settings),
        }
    )
    state.sections.setdefault("distillation", []).append(section)


def make_accelerator(state: RunState, params: DistillParams, out_dir: Path):
    """The `accelerate` Accelerator the training runs under: mixed precision on a GPU (bf16 where
    it is supported), TensorBoard logs into `out_dir` when tensorboard is installed."""
    from accelerate import Accelerator

    tracker = "tensorboard" if importlib.util.find_spec("tensorboard") else None
    precision = "no"
    if state.device.type == "cuda":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    accelerator = Accelerator(
        gradient_accumulation_steps=params.accumulation,
        mixed_precision=precision,
        cpu=state.device.type == "cpu",
        log_with=tracker,
        project_dir=str(out_dir),
    )
    if tracker:
        accelerator.init_trackers("distill")
    return accelerator


def prepare_student(state: RunState, params: DistillParams) -> None:
    """Make `student`, when given, the run's current model, and check the LoRA targets before
    the teacher's cache is computed."""
    if params.student is not None:
        state.adopt(
            load_model(OmegaConf.merge(state.cfg.model, {"path": params.student, "bnb": None}), state.device),
            f"student {params.student}",
        )
    if params.lora_rank is not None:
        check_lora_targets(state.model, params.lora_targets)


def load_teacher(state: RunState, params: DistillParams) -> Optional[LoadedModel]:
    """The teacher (`teacher`, else the run's original model), checked to share the student's
    vocabulary; None when nothing needs it (plain fine-tuning without draft prompts)."""
    teacher_cfg = (
        state.original_model_cfg()
        if params.teacher is None
        else OmegaConf.merge(state.cfg.model, {"path": params.teacher, "bnb": None})
    )
    teacher = (
        None if params.loss == "ce" and not params.draft_prompts else load_model(teacher_cfg, state.device)
    )
    if teacher is not None:
        check_same_vocabulary(state.tokenizer, teacher.tokenizer, state.model, teacher.model)
    return teacher


def optimizer_steps(params: DistillParams, processes: int) -> int:
    """The optimizer steps `params.tokens` makes over `processes` processes (at least one)."""
    steps = params.tokens // (params.seq_len * params.batch_size * params.accumulation * processes)
    if steps < 1:
        raise SlimlmError(
            f"distill.tokens={params.tokens} is less than one optimizer "
            f"step over {processes} processes; raise it"
        )
    return steps


def section_header(params: DistillParams, steps: int, processes: int) -> dict:
    """The report section's opening: the loss and how much training `steps` make."""
    return {
        "loss": params.loss,
        "steps": steps,
        "tokens": steps * params.seq_len * params.batch_size * params.accumulation * processes,
        "processes": processes,
    }


def cached_teacher_signal(
    state: RunState,
    params: DistillParams,
    teacher: LoadedModel,
    accelerator,
    windows: Windows,
    order: BatchOrder,
    steps: int,
    section: dict,
):
    """The offline teacher signal: its top-k log-probs over the windows the training uses,
    computed once and cached on disk (or read from the cache); `section` records which."""
    if params.top_k > state.model.config.vocab_size:
        raise ConfigError(
            f"distill.top_k={params.top_k} exceeds the vocabulary ({state.model.config.vocab_size})"
        )
    teacher_key = teacher.sha256 or f"id:{teacher.source.id}"
    with accelerator.main_process_first():  # the main process computes the cache; the others then read it
        signal, cache, reused = offline_teacher(
            teacher.model,
            teacher_key,
            windows.train,
            order.used(steps),
            params.top_k,
            params.temperature,
            params.batch_size,
        )
    section.update(
        {
            "teacher_signal": f"offline top-{params.top_k}",
            "teacher_cache": cache.name,
            "teacher_cache_reused": reused,
        }
    )
    return signal


def hidden_projector(
    params: DistillParams, student, teacher: Optional[LoadedModel], device: torch.device
) -> Optional[HiddenProjector]:
    """With `hidden_weight`, the trained projection of the student's hidden states onto the
    teacher's for the hidden-state loss; else None."""
    if params.hidden_weight > 0:
        s, t = student.config, teacher.model.config
        return HiddenProjector(
            s.hidden_size, t.hidden_size, s.num_hidden_layers, t.num_hidden_layers, params.hidden_loss
        ).to(device)
    return None


def train_settings(params: DistillParams, steps: int) -> TrainSettings:
    return TrainSettings(
        steps=steps,
        loss=params.loss,
        temperature=params.temperature,
        beta=loss_beta(params),
        ce_weight=params.ce_weight,
        hidden_weight=params.hidden_weight,
        on_policy_fraction=params.on_policy_fraction,
        lr=params.lr,
        weight_decay=params.weight_decay,
        warmup_fraction=params.warmup_fraction,
        max_grad_norm=params.max_grad_norm,
        eval_every=params.eval_every,
        checkpoint_every=params.checkpoint_every,
        seed=params.seed,
    )


def run_fingerprint(state: RunState, index: int, processes: int) -> dict:
    """What a checkpoint in the stage's directory must have been trained with for a rerun to
    resume from it (the recipe's stages, this stage's place among them, model, data, processes)."""
    return {
        "stages": OmegaConf.to_container(state.cfg.recipe.stages, resolve=True),
        "distill_stage": index,
        "model": str(state.cfg.model.path),
        "data": describe_calibration(state.cfg.data),
        "processes": processes,
    }


def trainable_student(model, params: DistillParams):
    """The student as training sees it: whole, with LoRA adapters, or with only its quantized
    layers' scales trainable."""
    if params.lora_rank is not None:
        return with_lora(model, params)
    if params.quant_scales:
        return with_trainable_scales(model)
    return model


def finished_student(trained, params: DistillParams):
    """The trained student back in the form later stages and exports take."""
    if params.lora_rank is not None:
        return finish_lora(trained)
    if params.quant_scales:
        freeze_quantized(trained)
    return trained


def with_trainable_scales(model):
    """The model with its decoder layers' QuantLinears made ScaleTrainedLinears and everything
    but their scales frozen (a quantized LM head stays as it is: a tied embedding reads its codes)."""
    _, blocks = decoder_blocks(model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if not replace_quantized(blocks):  # their scales are trainable
        raise SlimlmError(
            "distill.quant_scales trains the scales of quantized decoder layers, and this model has "
            "none: put a quantize stage before it"
        )
    return model


def with_lora(model, params: DistillParams):
    """The model with LoRA adapters (peft) on the target layers, everything else frozen;
    slimlm's quantized layers take adapters too (their codes stay frozen)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    config = LoraConfig(
        r=params.lora_rank,
        lora_alpha=params.lora_alpha,
        target_modules=list(params.lora_targets),
        lora_dropout=0.0,
    )
    config._register_custom_module(
        {QuantLinear: LoraLinear}
    )  # QuantLinear has in/out_features and a forward: peft's Linear wraps it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unsupported layer type")
        return get_peft_model(model, config)


def check_lora_targets(model, targets: List[str]) -> None:
    """Refuse an adapter on a quantized LM head tied to the embedding: the embedding reads the
    head's codes alone, so the two would part."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, QuantEmbedding):
        return
    head = next(name for name, module in model.named_modules() if module is embedding.head)
    if any(
        head == target or head.endswith(f".{target}") for target in targets
    ):  # peft matches names by suffix
        raise ConfigError(
            f"distill.lora_targets names the LM head ({head}), which is quantized and "
            "tied to the embedding: an adapter there would part the two; leave it out"
        )


def finish_lora(model):
    """The plain model back from peft: adapters merged into float weights; on quantized layers
    handed to the QuantLinear, which keeps them beside its codes (the artifact stores them there
    and the decoder runs them with its kernels)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLinear) and isinstance(module.base_layer, QuantLinear):
            (adapter,) = module.active_adapters
            down, up = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            module.base_layer.add_adapter(down.detach(), up.detach() * module.scaling[adapter])
            set_submodule(model, name, module.base_layer)
    return model.merge_and_unload()


def check(cfg, params: DistillParams, source) -> None:
    check_text_source(cfg.data.calibration, "calibration")


DISTILL = Stage(name="distill", params=DistillParams, run=run, check=check)
