# SPDX-License-Identifier: Apache-2.0
"""The host-staging benchmark (benchmarks/bench_host_staging.py) runs every
case both ways and writes one row per case."""

from __future__ import annotations

import json
import sys

from benchmarks import bench_host_staging


def test_every_case_is_timed_with_and_without_node_maps(tmp_path, monkeypatch):
    out = tmp_path / "staging.json"
    argv = ["bench", "--calls", "3", "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_host_staging.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [c[0] for c in bench_host_staging.CASES]
    assert all(r["with_maps_us"] > 0 and r["without_us"] > 0 for r in rows)
