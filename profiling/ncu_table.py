"""One row per kernel launch from an Nsight Compute report: where a kernel's time goes.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        -o OUT/kda python profiling/bench_kda.py --no-fla --profile-once --shapes 32768
    ncu -i OUT/kda.ncu-rep --csv --page details > OUT/kda_details.csv
    ncu -i OUT/kda.ncu-rep --csv --page raw > OUT/kda_raw.csv
    python profiling/ncu_table.py OUT/kda_details.csv [--raw OUT/kda_raw.csv]

Per launch: duration, DRAM throughput (% of peak) and bytes moved (from the raw page's byte
counts, or its DRAM rate times the duration), SM throughput,
registers, theoretical / achieved occupancy, warp cycles per issued instruction, and, with
`--raw`, the local-memory requests of register spills and the three largest stall reasons
(cycles per issued instruction). A kernel whose
DRAM and SM throughputs are both far below peak and whose cycles per instruction are high
is latency bound: more resident warps or more independent work per warp are the levers.
The metric names are those of Nsight Compute's details page (2023 to 2025 releases);
a metric a report lacks shows as '-'.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

_TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
               "s": 1e6, "second": 1e6}
_BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
               "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
# (section, metric name) on the details page -> column
_DETAILS = {
    ("GPU Speed Of Light Throughput", "Duration"): "duration",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_pct",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "sm_pct",
    ("Launch Statistics", "Registers Per Thread"): "regs",
    ("Launch Statistics", "Block Size"): "block",
    ("Launch Statistics", "Grid Size"): "grid",
    ("Occupancy", "Theoretical Occupancy"): "occ_theory_pct",
    ("Occupancy", "Achieved Occupancy"): "occ_achieved_pct",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "cycles_per_issue",
}
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_details(path: str) -> list[dict]:
    """Launches in report order: {'id', 'kernel', column: value} (columns of `_DETAILS`;
    duration in microseconds)."""
    launches: dict[str, dict] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(_csv_lines(f)):
            launch = launches.setdefault(row["ID"], {"id": row["ID"], "kernel": row["Kernel Name"]})
            column = _DETAILS.get((row.get("Section Name", ""), row.get("Metric Name", "")))
            value = _number(row.get("Metric Value", ""))
            if column is None or value is None:
                continue
            if column == "duration":
                unit = row.get("Metric Unit", "")
                if unit not in _TIME_UNITS:
                    raise ValueError(f"ncu_table: unknown time unit {unit!r} in {path}")
                value *= _TIME_UNITS[unit]
            launch[column] = value
    return list(launches.values())


def read_raw(path: str) -> dict[str, dict]:
    """Per launch ID: DRAM bytes read + written and the stall reasons, from the raw page
    (first data row: units)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(_csv_lines(f)))
    if len(rows) < 2:
        return {}
    header, units, data = rows[0], rows[1], rows[2:]
    out: dict[str, dict] = {}
    for row in data:
        fields = dict(zip(header, row))
        entry: dict = {"stalls": {}}
        total = 0.0
        for name in ("dram__bytes_read.sum", "dram__bytes_write.sum"):
            if name in fields and _number(fields[name]) is not None:
                unit = units[header.index(name)]
                total += _number(fields[name]) * _BYTE_UNITS.get(unit, 1.0)
                entry["dram_bytes"] = total
        rate, duration = (_number(fields.get(n, "")) for n in ("dram__bytes.sum.per_second", "gpu__time_duration.sum"))
        if "dram_bytes" not in entry and rate is not None and duration is not None:
            # the sections above collect the DRAM rate, not the byte counts: rate x time
            rate_unit = units[header.index("dram__bytes.sum.per_second")].removesuffix("/s")
            time_unit = units[header.index("gpu__time_duration.sum")]
            if rate_unit in _BYTE_UNITS and time_unit in _TIME_UNITS:
                entry["dram_bytes"] = rate * _BYTE_UNITS[rate_unit] * duration * _TIME_UNITS[time_unit] * 1e-6
        spills = _number(fields.get("derived__local_spilling_requests", ""))
        if spills is not None:
            entry["spill_requests"] = spills
        for name, text in fields.items():
            match = _STALL.match(name)
            if match and _number(text) is not None:
                entry["stalls"][match.group(1)] = _number(text)
        out[fields.get("ID", str(len(out)))] = entry
    return out


def _csv_lines(f):
    """ncu may print '==PROF==' lines before the CSV; skip everything before the header."""
    lines = iter(f)
    for line in lines:
        if line.startswith('"ID"'):
            yield line
            break
    yield from lines


def short_name(kernel: str, width: int = 40) -> str:
    name = kernel.split("(")[0].split("<")[0].strip()
    return name if len(name) <= width else name[: width - 1] + "~"


def format_table(launches: list[dict], raw: dict[str, dict] | None = None) -> str:
    def cell(launch, column, fmt):
        return fmt.format(launch[column]) if column in launch else "-"

    header = (f"{'kernel':40} {'us':>9} {'DRAM%':>6} {'DRAM GB':>8} {'SM%':>5} {'regs':>5} "
              f"{'occ th%':>7} {'occ ach%':>8} {'cyc/iss':>7} {'spill req':>10}  top stalls (cycles per issue)")
    lines = [header]
    total = 0.0
    for launch in launches:
        extra = (raw or {}).get(launch["id"], {})
        total += launch.get("duration", 0.0)
        dram = f"{extra['dram_bytes'] / 1e9:8.3f}" if "dram_bytes" in extra else f"{'-':>8}"
        stalls = sorted(extra.get("stalls", {}).items(), key=lambda kv: -kv[1])[:3]
        spills = f"{extra['spill_requests']:10.0f}" if "spill_requests" in extra else f"{'-':>10}"
        lines.append(
            f"{short_name(launch['kernel']):40} {cell(launch, 'duration', '{:9.1f}'):>9} "
            f"{cell(launch, 'dram_pct', '{:6.1f}'):>6} {dram} {cell(launch, 'sm_pct', '{:5.1f}'):>5} "
            f"{cell(launch, 'regs', '{:5.0f}'):>5} {cell(launch, 'occ_theory_pct', '{:7.1f}'):>7} "
            f"{cell(launch, 'occ_achieved_pct', '{:8.1f}'):>8} {cell(launch, 'cycles_per_issue', '{:7.1f}'):>7} "
            f"{spills}  "
            + " ".join(f"{reason} {value:.1f}" for reason, value in stalls)
        )
    lines.append(f"{'total':40} {total:9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("details", help="ncu -i REPORT --csv --page details > FILE")
    parser.add_argument("--raw", default="", help="ncu -i REPORT --csv --page raw > FILE")
    args = parser.parse_args(argv)
    launches = read_details(args.details)
    if not launches:
        sys.exit(f"ncu_table: no kernel launches in {args.details}")
    print(format_table(launches, read_raw(args.raw) if args.raw else None))


if __name__ == "__main__":
    main()
