"""benchmarks/nwor_kv_traffic's reading of an Nsight Compute report: the CSV ``ncu --import``
prints (its layout as seen on the H200: a header row, a units row, thousands separators), split
into windows at their marker kernels and summed per kernel family. No GPU and no ncu needed: a
script stands in for ncu."""

from __future__ import annotations

import csv
import io
import stat

import pytest

from benchmarks import nwor_kv_traffic as traffic

COLUMNS = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
           "Block Size", "Grid Size", "Device", "CC", *sorted(traffic.METRICS)]
UNITS = {"gpu__time_duration.sum": "ns", "dram__bytes_read.sum": "byte",
         "dram__bytes_write.sum": "byte"}


def launch(index: int, name: str, **fields: int) -> list[str]:
    """One CSV row; ``fields`` by the benchmark's field names, in bytes and ns, written in
    ncu's units (an L2 sector is 32 bytes)."""
    metric = {field: name for name, (field, _) in traffic.METRICS.items()}
    values = {metric[f]: f"{v // (32 if metric[f].startswith('lts__') else 1):,}"
              for f, v in fields.items()}
    return [str(index), "1", "python3.12", "127.0.0.1", name, "1", "7", "(1, 1, 1)",
            "(1, 1, 1)", "0", "9.0", *(values.get(m, "0") for m in sorted(traffic.METRICS))]


@pytest.fixture
def fake_ncu(tmp_path):
    rows = [
        launch(0, "cuda::<unnamed>::spin_kernel(long)", ns=2000),
        launch(1, "void vllm::reshape_and_cache_flash_kernel<bf16>(...)", ns=3000,
               l2_write_bytes=655360, l2_read_bytes=655360, dram_read_bytes=1_600_000),
        launch(2, "_plan_scratch_kernel", ns=800, l2_write_bytes=1_310_720),
        launch(3, "_commit_kv_kernel", ns=400, l2_write_bytes=131072, l2_read_bytes=131072),
        launch(4, "cuda::<unnamed>::spin_kernel(long)", ns=2000),
        launch(5, "void vllm::reshape_and_cache_flash_kernel<bf16>(...)", ns=6000,
               l2_write_bytes=1_310_720),
    ]
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    writer.writerow(COLUMNS)
    writer.writerow([""] * 11 + [UNITS.get(m, "sector") for m in sorted(traffic.METRICS)])
    writer.writerows(rows)
    (tmp_path / "report.csv").write_text(text.getvalue())
    script = tmp_path / "ncu"
    script.write_text(f"#!/bin/sh\necho '==PROF== Connected'\ncat {tmp_path / 'report.csv'}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_launches_are_read_in_base_units_and_split_into_windows(fake_ncu, tmp_path):
    launches = traffic.read_report(fake_ncu, tmp_path / "x.ncu-rep")
    assert [traffic.family(launch["name"]) for launch in launches] == [
        "other", "vllm_kv_write", "nwor_plan", "nwor_commit", "other", "vllm_kv_write"]
    assert launches[1]["l2_write_bytes"] == 655360  # 20,480 sectors of 32 bytes
    assert launches[1]["dram_read_bytes"] == 1_600_000  # "1,600,000" bytes
    first, second = traffic.split_windows(launches, 2)
    assert len(first) == 3 and len(second) == 1  # the markers themselves left out
    with pytest.raises(RuntimeError, match="2 window markers in the report, 3 windows run"):
        traffic.split_windows(launches, 3)


def test_a_kv_cell_sums_the_kv_kernels_per_token_and_per_step(fake_ncu, tmp_path):
    first, _ = traffic.split_windows(traffic.read_report(fake_ncu, tmp_path / "x"), 2)
    window = {"batch": 1, "steps": 2, "tokens": 8, "drafted": 8, "accepted": 6}
    cell = traffic.cell(window, first, "kv")
    assert cell["families"]["nwor_plan"] == {
        "launches": 1, "ns": 800, "l2_write_bytes": 1_310_720, "l2_read_bytes": 0,
        "l2_all_read_bytes": 0, "l2_all_write_bytes": 0, "dram_read_bytes": 0,
        "dram_write_bytes": 0}
    assert cell["kv_bytes_written_per_token"] == (655360 + 1_310_720 + 131072) // 8
    assert cell["kv_kernels_ns_per_step"] == (3000 + 800 + 400) // 2
    assert cell["acceptance_measured"] == 0.75


def test_the_summary_puts_nwor_over_vllm_alone_per_cell(fake_ncu, tmp_path):
    first, second = traffic.split_windows(traffic.read_report(fake_ncu, tmp_path / "x"), 2)
    window = {"batch": 1, "steps": 2, "tokens": 8, "drafted": 8, "accepted": 6}
    cells = [{"pass": "kv", "acceptance": 0.7, "side": side, **traffic.cell(window, part, "kv")}
             for side, part in (("on", first), ("off", second))]
    [row] = traffic.summary(cells)
    written = row["kv_kernels_per_step"]["l2_write_bytes"]
    assert written == {"off": 655360, "on": 1_048_576, "on_over_off": 1.6}
    assert row["kv_bytes_written_per_token"]["on_over_off"] == 1.6


def test_the_nodes_pass_sums_per_kernel_and_names_the_kernels_nwor_changes(fake_ncu, tmp_path):
    first, second = traffic.split_windows(traffic.read_report(fake_ncu, tmp_path / "x"), 2)
    window = {"batch": 1, "steps": 1, "tokens": 4, "drafted": 4, "accepted": 3}
    on, off = (traffic.cell(window, part, "nodes") for part in (first, second))
    assert set(on["kernels"]) == {"reshape_and_cache_flash_kernel", "_plan_scratch_kernel",
                                  "_commit_kv_kernel"}
    assert on["per_step"]["ns"] == 3000 + 800 + 400 and off["per_step"]["ns"] == 6000
    difference = traffic.nodes_difference(off, on)
    assert difference["ns_per_step"] == {"off": 6000, "on": 4200, "on_over_off": 0.7}
    assert [row["kernel"] for row in difference["kernels_differing_most"]] == [
        "reshape_and_cache_flash_kernel", "_plan_scratch_kernel", "_commit_kv_kernel"]
    assert difference["kernels_differing_most"][1] == {
        "kernel": "_plan_scratch_kernel", "off": {"launches": 0, "ns": 0},
        "on": {"launches": 1, "ns": 800}}
