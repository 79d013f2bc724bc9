import json

import pytest

from slimlm.errors import SlimlmError
from slimlm.eval.compare import compare
from slimlm.eval.plots import pareto_front
from slimlm.eval.report import TABLES, add_deltas, markdown_table, markdown_tables


def test_pareto_front_keeps_only_undominated_points():
    points = [(100.0, 10.0), (50.0, 11.0), (60.0, 12.0), (25.0, 15.0), (25.0, 16.0)]
    assert pareto_front(points) == [3, 1, 0]


def test_deltas_use_the_reference_when_known():
    rows = add_deltas(
        [
            {"name": "fp32", "ppl": 10.0, "bytes": 400},
            {"name": "q", "ppl": 11.0, "bytes": 100, "reference_nll": 2.302585092994046},  # ln 10
        ]
    )
    assert rows[1]["delta_ppl_pct"] == pytest.approx(10.0)
    assert rows[1]["size_pct_of_first"] == pytest.approx(25.0)


def test_table_shows_only_columns_some_row_has():
    lines = markdown_table(
        [{"name": "a", "ppl": 3.0}, {"name": "b", "ppl": 4.0, "kl_mean": 0.01}], TABLES[0][1]
    )
    assert lines[0] == "| model | ppl | KL |"
    assert lines[2] == "| a | 3.0000 | – |"


def write_run(directory, recipe, rows):
    directory.mkdir(parents=True)
    (directory / "report.json").write_text(json.dumps({"recipe": recipe, "rows": rows}))


def test_compare_joins_runs_and_sweeps(tmp_path):
    write_run(
        tmp_path / "runs" / "a" / "t1", "a", [{"name": "fp32", "ppl": 10.0, "bytes": 400, "kl_mean": 0.0}]
    )
    write_run(tmp_path / "sweep" / "0_b", "b", [{"name": "w8", "ppl": 10.1, "bytes": 150, "kl_mean": 0.002}])
    write_run(tmp_path / "sweep" / "1_c", "c", [{"name": "w4", "ppl": 11.0, "bytes": 90, "kl_mean": 0.05}])
    markdown = compare([tmp_path / "runs" / "a" / "t1", tmp_path / "sweep"], tmp_path / "out")
    assert "| a: fp32 |" in markdown and "| b: w8 |" in markdown and "| c: w4 |" in markdown
    assert (tmp_path / "out" / "comparison.png").stat().st_size > 1000
    assert len(json.loads((tmp_path / "out" / "comparison.json").read_text())["rows"]) == 3


def test_compare_refuses_paths_without_runs(tmp_path):
    with pytest.raises(SlimlmError, match="does not exist"):
        compare([tmp_path / "missing"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SlimlmError, match="no finished run"):
        compare([tmp_path / "empty"], tmp_path / "out")


def test_zero_shot_tables_name_every_task_with_its_standard_error(tmp_path):
    """Tasks are found in the rows (a task file's by its name:), each accuracy with its standard
    error beside it; compare says which differences are beyond the two errors combined."""
    first = {
        "name": "fp32",
        "piqa_acc": 0.70,
        "piqa_acc_stderr": 0.01,
        "piqa_n": 1838,
        "my_cloze_acc": 0.60,
        "my_cloze_acc_stderr": 0.02,
        "my_cloze_n": 500,
    }
    second = {
        "name": "w4",
        "piqa_acc": 0.66,
        "piqa_acc_stderr": 0.011,
        "piqa_n": 1838,
        "my_cloze_acc": 0.59,
        "my_cloze_acc_stderr": 0.02,
        "my_cloze_n": 500,
    }
    lines = markdown_tables([first, second])
    assert "### Zero-shot accuracy (%)" in lines
    assert "| model | PIQA acc | ± | my_cloze acc | ± |" in lines
    assert "| fp32 | 70.00 | 1.00 | 60.00 | 2.00 |" in lines
    write_run(tmp_path / "a", "a", [first, second])
    markdown = compare([tmp_path / "a"], tmp_path / "out")
    assert "| a: w4 | PIQA | -4.00 | 2.91 | yes |" in markdown  # 1.96 * sqrt(0.01² + 0.011²)
    assert "| a: w4 | my_cloze | -1.00 | 5.54 | no |" in markdown
