"""benchmarks/ncu_source_summary.py on a small source page written as Nsight Compute writes it."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "ncu_source_summary", os.path.join(ROOT, "benchmarks", "ncu_source_summary.py"))
summary_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary_tool)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_long_sb",'
          '"stall_wait","stall_barrier","stall_long_sb (Not Issued)"')
ROWS = [
    '"0x10","      LDC R1, c[0x0][0x28]","2","2","64","0","2","0","0"',
    '"0x20","      LD.E.64 R8, desc[UR10][R12.64]","0","0","64","0","0","0","0"',
    '"0x30","      LOP3.LUT R10, R8, 0xffff, RZ, 0xc0, !PT","6","6","64","5","1","0","5"',
    '"0x40","      BAR.SYNC.DEFER_BLOCKING 0x0","2","2","32","0","0","2","0"',
]


def _page(tmp_path, header=HEADER, rows=ROWS):
    path = tmp_path / "source.csv"
    path.write_text('"Kernel Name","merge_topk_ids_and_table_rank(...)"\n'
                    + "\n".join([header, *rows]) + "\n")
    return str(path)


def test_counts_shares_and_hot_instructions(tmp_path):
    summary = summary_tool.summarize(*summary_tool.read_source_page(_page(tmp_path)), top=2)
    assert summary["instructions"] == 224
    assert summary["samples"] == 10
    # the Not Issued column repeats the long-scoreboard samples: it must not count twice
    assert summary["stalls"] == {"long_sb": 0.5, "wait": 0.3, "barrier": 0.2}
    # the two with the most samples, in program order, each with its largest reasons
    assert [(h["line"], h["samples"], h["reasons"]) for h in summary["top"]] == [
        (0, 2, ["wait"]), (2, 6, ["long_sb", "wait"])]
    assert summary["top"][1]["sass"].startswith("LOP3.LUT R10")


def test_the_command_line_prints_instructions_per_warp(tmp_path, capsys):
    summary_tool.main([_page(tmp_path), "--warps", "4", "--top", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("224 warp instructions executed, 56 per warp, 10 stall samples")
    assert out[1] == "long_sb 50%  wait 30%  barrier 20%"
    assert out[2].startswith("lines    0-3        56.0 instructions a warp,   10 samples")
    assert "LOP3.LUT" in out[3] and out[3].rstrip().endswith("long_sb, wait")


def test_the_program_is_cut_after_each_barrier(tmp_path):
    rows = ROWS + [
        '"0x50","      DSETP.GT.AND P1, PT, R20, R28, PT","3","3","32","0","3","0","0"',
        '"0x60","  @!P2  BAR.RED.OR.DEFER_BLOCKING 0x0, !PT","1","1","32","0","0","1","0"',
        '"0x70","      EXIT","0","0","32","0","0","0","0"',
    ]
    summary = summary_tool.summarize(*summary_tool.read_source_page(_page(tmp_path, rows=rows)))
    assert [(s["first"], s["last"], s["instructions"], s["samples"], s["reasons"])
            for s in summary["segments"]] == [
        (0, 3, 224, 10, ["long_sb", "wait"]),  # up to and with the first barrier
        (4, 5, 64, 4, ["wait", "barrier"]),  # a predicated barrier cuts too
        (6, 6, 32, 0, [])]
    assert summary["segments"][1]["end"].endswith("BAR.RED.OR.DEFER_BLOCKING 0x0, !PT")
    assert summary["segments"][2]["end"] == "end"
    assert sum(s["instructions"] for s in summary["segments"]) == summary["instructions"]


def test_a_page_that_is_not_a_source_page_is_named(tmp_path):
    with pytest.raises(ValueError, match="no 'Address' header"):
        summary_tool.read_source_page(_page(tmp_path, header='"Metric","Value"', rows=[]))
    header, rows = summary_tool.read_source_page(
        _page(tmp_path, header='"Address","Source"', rows=['"0x10","NOP"']))
    with pytest.raises(ValueError, match="no 'Warp Stall Sampling"):
        summary_tool.summarize(header, rows)
