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


@pytest.mark.parametrize("model, gpus, tokens", [("qwen3-30b-a3b", 8, 4 * 1024 * 1024), ("tiny", 3, 32768),
                                                  ("deepseek-v3", 1152, 4 * 1024 * 1024)])
def test_the_roofline_panel_draws_a_point_per_stage_and_pass_under_its_own_roof_with_labels_apart(model, gpus, tokens):
    from disagmoe.cli.plan_cmd import build_request
    from disagmoe.placement.solver import choose, roofline_rows

    choice = choose(build_request(model, "h200-sxm" if model != "deepseek-v3" else "gb200-nvl72", gpus, None, tokens))
    layer, step = roofline_rows(choice.cost, choice.problem, choice.candidate)
    ceil = choice.problem.ceilings
    points = report.roofline_points(layer, ceil, step)
    with_flops = {(r["stage"], r["pass"]) for r in layer if r["flops"] > 0}
    assert {(p["stage"], p["pass"]) for p in points} == with_flops and len(points) == len(with_flops)
    rate = {"hbm": ceil.hbm_bytes_per_s, "nvlink": ceil.nvlink_bytes_per_s, "scaleout": ceil.scaleout_bytes_per_s}
    for p in points:  # each against its own roof's intensity, never above that roof
        assert p["tflops"] <= min(ceil.flops_per_s, p["intensity"] * rate[p["roof"]]) / 1e12 * (1 + 1e-9)
    assert sum(p["share"] for p in points) <= 1
    fig = report.figure(layer, ceil, "t", step_rows=step)
    ax = fig.axes[0]
    offsets = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert sorted(offsets) == sorted((p["intensity"], p["tflops"]) for p in points)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the label, not its leader line
    assert len(boxes) == len(points)
    inside = ax.get_window_extent(renderer)
    for i, a in enumerate(boxes):
        assert inside.x0 <= a.x0 and a.x1 <= inside.x1 + 1 and inside.y0 <= a.y0 and a.y1 <= inside.y1
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    import matplotlib.pyplot as plt

    plt.close(fig)
