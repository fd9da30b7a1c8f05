"""Calibrated hardware presets: fractions from measurements, provenance kept, GPU probe."""

import pytest
import torch
import yaml

from disagmoe.bench.hardware import Measured, calibrated, measure, preset_yaml
from disagmoe.config import HardwareConfig, load_hardware


def test_fractions_come_from_the_measurements():
    hw = load_hardware("h200-sxm")
    m = Measured(matmul_tflops=777.0, hbm_gbps=4175.0, nvlink_gbps=390.0, nvlink_latency_us=7.5)
    cal = calibrated(hw, m)
    assert cal.efficiency.matmul == pytest.approx(777 / 989)
    assert cal.efficiency.hbm == pytest.approx(4175 / 4800)
    assert cal.efficiency.nvlink == pytest.approx(390 / 450)
    assert cal.nvlink_latency_us == 7.5
    assert cal.bf16_tflops == hw.bf16_tflops  # peaks stay the datasheet's


def test_single_gpu_keeps_the_link_figures_and_yaml_round_trips():
    hw = load_hardware("h100-sxm")
    cal = calibrated(hw, Measured(matmul_tflops=2000.0, hbm_gbps=3000.0, nvlink_gbps=None, nvlink_latency_us=None))
    assert cal.efficiency.matmul == 1.0  # clipped: a fraction never exceeds the peak
    assert cal.efficiency.nvlink == hw.efficiency.nvlink and cal.nvlink_latency_us == hw.nvlink_latency_us
    text = preset_yaml(cal, Measured(2000.0, 3000.0, None, None), {"gpu": "test"}, "disagmoe bench hardware")
    assert text.startswith("# Calibrated by `disagmoe bench hardware`")
    assert HardwareConfig.model_validate(yaml.safe_load(text)) == cal


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        measure()


@pytest.mark.gpu
def test_measure_on_a_gpu():
    m = measure(warmup=2, iters=5)
    assert 100 < m.matmul_tflops < 5000 and 500 < m.hbm_gbps < 20000
    if torch.cuda.device_count() > 1:
        assert m.nvlink_gbps > 10 and m.nvlink_latency_us > 0
