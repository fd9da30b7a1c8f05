"""`roofline.report`'s units: each value in the unit that suits it, a non-zero one never as 0."""

import pytest

from disagmoe.roofline import report


@pytest.mark.parametrize("t, text", [
    (2.5, "2.5 s"), (0.253, "253 ms"), (1.03e-5, "10.3 us"), (9.18e-7, "918 ns"), (3.2e-12, "0.0032 ns"),
    (1234.0, "1234 s"), (0.0, "-"), (None, "-"), (float("inf"), "inf s"),
])
def test_seconds_picks_a_unit_per_value(t, text):
    assert report.seconds(t) == text


@pytest.mark.parametrize("gib, text", [
    (125.82, "126 GiB"), (1.5, "1.5 GiB"), (0.00177, "1.81 MiB"), (2e-6, "2.1 KiB"), (1e-10, "0.107 B"),
    (0.0, "-"),
])
def test_memory_picks_a_unit_per_value(gib, text):
    assert report.memory(gib) == text


def test_no_nonzero_value_reads_as_zero():
    for x in (10.0 ** -k for k in range(0, 15)):
        for text in (report.seconds(x), report.memory(x)):
            number = float(text.split()[0])
            assert number > 0, text
