"""Reading perf's report for the benchmark's on-CPU split."""

from __future__ import annotations

from bench.perf.profiles import parse_perf_report


def test_a_row_is_its_first_percentage_and_the_name_after_its_percentages() -> None:
    by_object = "    75.49%  libpython3.11.so.1.0\n    11.10%  [kernel.kallsyms]\n\n"
    assert parse_perf_report(by_object) == {
        "libpython3.11.so.1.0": 0.7549,
        "[kernel.kallsyms]": 0.111,
    }
    # --children: the inclusive share comes first, then the symbol's own.
    children = "     5.05%     0.03%  [k] sock_write_iter\n     4.93%     0.15%  [k] tcp_sendmsg\n"
    assert parse_perf_report(children) == {"[k] sock_write_iter": 0.0505, "[k] tcp_sendmsg": 0.0493}
