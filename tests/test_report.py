import json

import pytest

from slimlm.errors import SlimlmError
from slimlm.eval.compare import compare
from slimlm.eval.plots import pareto_front
from slimlm.eval.report import TABLES, add_deltas, markdown_table


def test_pareto_front_keeps_only_undominated_points():
    points = [(100.0, 10.0), (50.0, 11.0), (60.0, 12.0), (25.0, 15.0), (25.0, 16.0)]
    assert pareto_front(points) == [3, 1, 0]


def test_deltas_use_the_reference_when_known():
    rows = add_deltas([
        {"name": "fp32", "ppl": 10.0, "bytes": 400},
        {"name": "q", "ppl": 11.0, "bytes": 100, "reference_nll": 2.302585092994046},  # ln 10
    ])
    assert rows[1]["delta_ppl_pct"] == pytest.approx(10.0)
    assert rows[1]["size_pct_of_first"] == pytest.approx(25.0)


def test_table_shows_only_columns_some_row_has():
    lines = markdown_table([{"name": "a", "ppl": 3.0}, {"name": "b", "ppl": 4.0, "kl_mean": 0.01}], TABLES[0][1])
    assert lines[0] == "| model | ppl | KL |"
    assert lines[2] == "| a | 3.0000 | – |"


def write_run(directory, recipe, rows):
    directory.mkdir(parents=True)
    (directory / "report.json").write_text(json.dumps({"recipe": recipe, "rows": rows}))


def test_compare_joins_runs_and_sweeps(tmp_path):
    write_run(tmp_path / "runs" / "a" / "t1", "a", [{"name": "fp32", "ppl": 10.0, "bytes": 400, "kl_mean": 0.0}])
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
