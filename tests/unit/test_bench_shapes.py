"""benchmarks/shapes.py (issue 39's shapes): the rotation of the sinks, the summary of a
shape's saves, its markdown table and the report's targets from its result."""

from __future__ import annotations

from benchmarks.report import render, section_shapes, section_targets, target_rows
from benchmarks.shapes import order, parse_shapes, summarise, table


def _save(seconds: float, parts: int, visibility: str | None = None) -> dict:
    x = {"seconds": seconds, "parts_added": parts, "merged_parts": 0}
    if visibility:
        x["visibility"] = visibility
    return x


def _shapes() -> dict:
    small = summarise(
        200,
        1,
        {
            "baseline": [_save(4.0, 200), _save(5.0, 200), _save(4.4, 200)],
            "attach": [_save(4.4, 1, "batch"), _save(5.0, 1, "batch"), _save(4.0, 1, "batch")],
        },
    )
    big = summarise(
        20,
        50,
        {
            "baseline": [_save(2.0, 1000), _save(2.0, 1000), _save(2.0, 1000)],
            "attach": [
                _save(4.0, 1000, "partition"),
                _save(5.0, 1000, "partition"),
                _save(4.0, 1000, "partition"),
            ],
        },
    )
    return {"rows": 200_000, "reps": 3, "shapes": [small, big]}


def test_the_sinks_take_turns_to_go_first():
    assert order(0) == ("baseline", "attach")
    assert order(1) == ("attach", "baseline")
    assert order(2) == order(0)


def test_shapes_are_parsed_as_tasks_by_partition_values():
    assert parse_shapes("200x1,20x50") == ((200, 1), (20, 50))
    assert parse_shapes("4x1,") == ((4, 1),)


def test_a_shape_is_summarised_with_paired_speed_ratios():
    small, big = _shapes()["shapes"]
    # baseline s / attach s of the same repetition: 4/4.4, 5/5, 4.4/4
    assert round(small["ratio"]["median"], 3) == 1.0
    assert round(small["ratio"]["min"], 3) == round(4 / 4.4, 3)
    assert round(small["ratio"]["max"], 3) == 1.1
    assert small["sinks"]["baseline"]["seconds"]["median"] == 4.4
    assert small["sinks"]["attach"]["parts_added"] == 1
    assert small["visibility"] == "batch"
    assert big["ratio"]["median"] == 0.5
    assert big["sinks"]["baseline"]["parts_added"] == 1000


def test_the_shapes_table_has_a_row_per_shape():
    lines = table(_shapes())
    assert len(lines) == 2 + 2
    assert lines[2] == "| 200 x 1 | 4.40 | 4.40 | 1.000 (0.909 - 1.100) | 200 | 1 | batch |"
    assert lines[3] == "| 20 x 50 | 2.00 | 4.00 | 0.500 (0.400 - 0.500) | 1000 | 1000 | partition |"


def test_a_merged_baseline_part_is_flagged():
    out = _shapes()
    out["shapes"][0]["sinks"]["baseline"]["merged_parts"] = 3
    assert "| 200 (3 merged) |" in table(out)[2]


def test_the_shapes_are_judged_against_issue_39s_targets():
    met = {name: ok for name, _, ok in target_rows({"shapes": _shapes()})}
    small = "(200 tasks x 1 partition values, batch save)"
    big = "(20 tasks x 50 partition values, batch save)"
    assert met[f"attach/baseline >= 0.80 {small}"]
    assert met[f"parts added per batch <= partition values {small}"]
    assert not met[f"attach/baseline >= 0.80 {big}"]
    assert not met[f"parts added per batch <= partition values {big}"]


def test_a_shape_target_not_met_names_its_floor():
    lines = section_targets({"shapes": _shapes()})
    ratio = next(line for line in lines if line.startswith("| attach/baseline >= 0.80 (20 tasks"))
    assert "paired ratios of this run 0.400 - 0.500: below the target in every repetition" in ratio
    assert "attach adds +2.00 s a save" in ratio
    assert "one MOVE per task's staging" in ratio
    parts = next(line for line in lines if line.startswith("| parts added") and "(20 tasks" in line)
    assert "visibility=partition" in parts


def test_the_section_is_rendered_only_with_figures():
    assert section_shapes({}) == []
    lines = section_shapes({"shapes": _shapes()})
    assert lines[0].startswith("## 2f.")
    assert "| 200 x 1 | 4.40 |" in "\n".join(lines)
    doc = render(
        {
            "command": "x",
            "sizes": {"name": "quick"},
            "started": "now",
            "machine": {
                "cpu": "c",
                "cores": 2,
                "kernel": "k",
                "java": "j",
                "git": "g",
                "free_g": "",
                **dict.fromkeys(
                    ("python", "pyspark", "pyarrow", "clickhouse_connect", "chdb"), "1"
                ),
            },
            "shapes": _shapes(),
        }
    )
    assert "## 2f." in doc
