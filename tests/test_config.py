"""Configs: presets load, bad input is rejected with one clear message."""

import json

import pytest
import yaml

from disagmoe import config as cfg
from disagmoe.model_ref import load_model


@pytest.mark.parametrize("name", cfg.preset_names("models"))
def test_model_presets_load_and_round_trip(name):
    m = load_model(name)
    again = cfg.ModelConfig.model_validate(yaml.safe_load(m.to_yaml()))
    assert again == m


@pytest.mark.parametrize("name", cfg.preset_names("hardware"))
def test_hardware_presets_load(name):
    h = cfg.load_hardware(name)
    assert h.name == name and h.nvlink_domain in (8, 72)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as err:
        load_model("mixtral-8x8b")
    for name in cfg.preset_names("models"):
        assert name in str(err.value)


def _tiny_dict():
    return yaml.safe_load((cfg.PRESETS_DIR / "models" / "tiny.yaml").read_text())


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_sizes": 64}, "unknown key"),
        ({"hidden_size": "wide"}, "hidden_size"),
        ({"num_layers": -2}, "num_layers"),
        ({"top_k": 9}, "top_k=9 is larger than num_experts=8"),
        ({"router": {"topk_groups": 2}}, "topk_groups"),
        ({"attention": "mla"}, "mla"),
    ],
)
def test_bad_model_config_is_one_clear_error(tmp_path, change, needle):
    data = _tiny_dict() | change
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as err:
        load_model(str(path))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_model(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(bad))


def test_train_config_overrides(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "steps": 5}))
    t = cfg.load_train_config(path, ["optim.lr=0.01", "steps=7", "env.FOO=bar"])
    assert (t.optim.lr, t.steps, t.env) == (0.01, 7, {"FOO": "bar"})
    with pytest.raises(ValueError, match="key=value"):
        cfg.load_train_config(path, ["steps"])
    with pytest.raises(ValueError, match="unknown key"):
        cfg.load_train_config(path, ["stepz=3"])


def test_schemas_list_every_key_and_forbid_others():
    for model in (cfg.TrainConfig, cfg.ModelConfig, cfg.HardwareConfig, cfg.Plan):
        schema = json.loads(json.dumps(model.model_json_schema()))
        assert set(schema["properties"]) == set(model.model_fields)
        assert schema["additionalProperties"] is False


HUGE = 10**30


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "vocab_size", "num_layers", "expert_ffn_size"])
def test_a_huge_model_size_is_refused_in_one_line(tmp_path, field):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(_tiny_dict() | {field: HUGE}))
    with pytest.raises(ValueError) as err:
        load_model(str(path))
    message = str(err.value)
    assert f"{path}: {field}: {HUGE} is too large" in message and f"{cfg.MAX_DIM:,}" in message
    assert "\n" not in message


@pytest.mark.parametrize("field", ["attention_ranks", "expert_ranks", "colocated_ranks", "pipeline_groups",
                                   "batch_size", "micro_batches", "steps", "seed", "recv_timeout_s"])
def test_a_huge_train_setting_is_refused_before_anything_runs(tmp_path, field):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny"}))
    with pytest.raises(ValueError, match=f"{field}: .*too large"):
        cfg.load_train_config(path, [f"{field}={HUGE}"])


def test_the_bounds_admit_real_jobs():
    cfg.ClusterConfig(hardware=cfg.load_hardware("gb200-nvl72"), num_gpus=100_000)
    cfg.ModelConfig.model_validate(load_model("deepseek-v3").model_dump() | {"vocab_size": 1 << 20})


@pytest.mark.parametrize("field", ["attention_gpus", "expert_gpus", "gpus", "pipeline_groups"])
def test_a_plan_with_a_huge_gpu_count_is_refused(field):
    from disagmoe.placement.solver import choose

    request = cfg.PlanConfig(model=load_model("tiny"), seq_len=64, global_batch_tokens=512,
                             cluster=cfg.ClusterConfig(hardware=cfg.load_hardware("h200-sxm"), num_gpus=2))
    data = choose(request).plan.model_dump(mode="json") | {field: HUGE}
    with pytest.raises(ValueError, match=f"plan.yaml: {field}: {HUGE} is too large"):
        cfg.validate(cfg.Plan, data, "plan.yaml")


@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
@pytest.mark.parametrize("field", ["hbm_gbps", "nvlink_gbps", "bf16_tflops", "collective_latency_us"])
def test_a_non_finite_hardware_figure_is_refused(tmp_path, field, value):
    data = yaml.safe_load((cfg.PRESETS_DIR / "hardware" / "h200-sxm.yaml").read_text())
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data).replace(f"{field}: {data[field]}", f"{field}: {value}"))
    with pytest.raises(ValueError, match=f"{field}: Input should be a finite number|{field}: Input should be greater"):
        cfg.load_hardware(str(path))


@pytest.mark.parametrize("load", [float("nan"), float("inf"), -1.0])
def test_a_load_histogram_must_be_finite_and_non_negative(load):
    model = load_model("tiny")
    histogram = [[1.0] * model.num_experts for _ in range(model.num_moe_layers)]
    histogram[1][3] = load
    with pytest.raises(ValueError, match=r"MoE layer 1, expert 3 has load"):
        cfg.PlanConfig(model=model, seq_len=64, load_histogram=histogram,
                       cluster=cfg.ClusterConfig(hardware=cfg.load_hardware("h200-sxm"), num_gpus=2))


@pytest.mark.parametrize("text, key, lines", [
    ("model: tiny\nsteps: 3\nseed: 1\nsteps: 5\n", "steps", "line 4 (first at line 2)"),
    ("model: tiny\noptim:\n  lr: 0.1\n  lr: 0.2\n", "lr", "line 4 (first at line 3)"),
], ids=["top-level", "nested"])
def test_a_duplicate_yaml_key_is_refused_naming_key_and_file(tmp_path, text, key, lines):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{path}: key '{key}' appears twice at {lines.replace('(', '[(]').replace(')', '[)]')}"):
        cfg.load_train_config(path)


def test_a_duplicate_json_key_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mixtral", "hidden_size": 8, "hidden_size": 16}')
    with pytest.raises(ValueError, match=rf"{path}: key 'hidden_size' appears twice"):
        load_model(str(path))


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_bytes(b"model: tiny\nname: \xff\n")
    with pytest.raises(ValueError, match=rf"{path} is not UTF-8 text"):
        cfg.load_train_config(path)


def test_the_sync_check_refuses_the_loop_experts_on_a_gpu():
    """The loop backend (the reference) reads expert offsets on the host in every step: with
    forbid_host_syncs on a GPU every step would raise, so the config says so before the run."""
    with pytest.raises(ValueError, match="the loop backend .* reads each expert's row offsets on the host, .* set "
                                         "experts_backend: grouped_mm or triton"):
        cfg.TrainConfig(model="tiny", device="cuda", forbid_host_syncs=True, experts_backend="loop")
    for backend in ("grouped_mm", "triton"):
        cfg.TrainConfig(model="tiny", device="cuda", forbid_host_syncs=True, experts_backend=backend)
    cfg.TrainConfig(model="tiny", device="cpu", forbid_host_syncs=True, experts_backend="loop")  # no check on CPU


def test_offload_optimizer_is_off_by_default_and_refused_where_it_cannot_apply(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny"}))
    default = cfg.load_train_config(path)
    assert default.offload_optimizer is False and default.offload_bucket_mib == 256
    on = cfg.load_train_config(path, ["offload_optimizer=true", "offload_bucket_mib=64"])
    assert on.offload_optimizer and on.offload_bucket_mib == 64
    with pytest.raises(ValueError, match="offload_optimizer with cuda_graphs: on: .*set cuda_graphs: off"):
        cfg.TrainConfig(model="tiny", mode="single", device="cuda", offload_optimizer=True, cuda_graphs="on",
                        experts_backend="triton")
    with pytest.raises(ValueError, match="offload_bucket_mib"):
        cfg.load_train_config(path, ["offload_bucket_mib=0"])
    with pytest.raises(ValueError, match="optim.offload_optimizer"):  # it is a run setting, not optim's
        cfg.load_train_config(path, ["optim.offload_optimizer=true"])


def test_the_update_kernel_is_triton_by_default_and_takes_torch(tmp_path):
    """optim.update_kernel: triton unless set (flipped after its GPU comparison passed); torch loads from YAML
    and overrides; anything else is refused, naming the choices."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "optim": {"update_kernel": "torch"}}))
    assert cfg.OptimConfig().update_kernel == "triton"
    assert cfg.load_train_config(path).optim.update_kernel == "torch"
    assert cfg.load_train_config(path, ["optim.update_kernel=triton"]).optim.update_kernel == "triton"
    with pytest.raises(ValueError, match="update_kernel"):
        cfg.load_train_config(path, ["optim.update_kernel=cuda"])
    with pytest.raises(ValueError, match="update_kernel"):  # an optim key, not a run setting
        cfg.load_train_config(path, ["update_kernel=triton"])


def test_fp8_dense_is_on_unless_set_false_and_is_refused_without_precision_fp8():
    """Unset, the dense projections run in FP8 under precision fp8 (`RUN_FP8_DENSE`: session 34's
    blockwise parity run); false keeps them bf16; true under another precision is refused."""
    base = dict(model="tiny", device="cuda", experts_backend="triton")
    assert cfg.RUN_FP8_DENSE is True
    assert cfg.TrainConfig(precision="fp8", **base).dense_precision == "fp8"
    assert cfg.TrainConfig(precision="fp8", fp8_dense=True, **base).dense_precision == "fp8"
    assert cfg.TrainConfig(precision="fp8", fp8_dense=False, **base).dense_precision == "bf16"
    assert cfg.TrainConfig(precision="bf16", **base).dense_precision == "bf16"
    assert cfg.TrainConfig(precision="bf16", fp8_dense=False, **base).dense_precision == "bf16"
    with pytest.raises(ValueError, match="fp8_dense: true runs the dense projections in FP8 under precision: fp8"):
        cfg.TrainConfig(precision="bf16", fp8_dense=True, **base)


def test_fp8_dense_scaling_is_blockwise_unless_set_and_is_refused_where_the_dense_projections_are_bf16():
    """Unset, FP8 dense projections scale blockwise (`FP8_DENSE_SCALING`), whether fp8_dense is
    unset or true; rowwise is a choice, with fp8_dense unset too; with the dense projections in bf16
    there is nothing to scale (None), and setting it is refused."""
    base = dict(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    assert cfg.FP8_DENSE_SCALING == "blockwise"
    assert cfg.TrainConfig(**base).dense_fp8_scaling == "blockwise"
    assert cfg.TrainConfig(fp8_dense=True, **base).dense_fp8_scaling == "blockwise"
    assert cfg.TrainConfig(fp8_dense_scaling="rowwise", **base).dense_fp8_scaling == "rowwise"
    assert cfg.TrainConfig(fp8_dense=True, fp8_dense_scaling="rowwise", **base).dense_fp8_scaling == "rowwise"
    assert cfg.TrainConfig(fp8_dense=False, **base).dense_fp8_scaling is None
    assert cfg.TrainConfig(**{**base, "precision": "bf16"}).dense_fp8_scaling is None
    with pytest.raises(ValueError, match=r"fp8_dense_scaling: blockwise scales .* set precision: fp8 \(with fp8_dense "
                                         r"unset or true\)"):
        cfg.TrainConfig(fp8_dense=False, fp8_dense_scaling="blockwise", **base)
    with pytest.raises(ValueError, match="fp8_dense_scaling: rowwise scales"):
        cfg.TrainConfig(**{**base, "precision": "bf16"}, fp8_dense_scaling="rowwise")
    with pytest.raises(ValueError, match="fp8_dense_scaling"):
        cfg.TrainConfig(fp8_dense=True, fp8_dense_scaling="tensorwise", **base)


def test_fp8_expert_backward_follow_precision_fp8_and_are_refused_without_it():
    base = dict(model="tiny", device="cuda", experts_backend="triton")
    assert cfg.TrainConfig(precision="fp8", **base).expert_backward_precision == "bf16-wgrad"
    for backward in ("fp8", "bf16-wgrad", "bf16"):
        assert cfg.TrainConfig(precision="fp8", fp8_expert_backward=backward, **base).expert_backward_precision == backward
    assert cfg.TrainConfig(precision="bf16", **base).expert_backward_precision is None
    with pytest.raises(ValueError, match="fp8_expert_backward chooses .* set precision: fp8"):
        cfg.TrainConfig(precision="bf16", fp8_expert_backward="bf16-wgrad", **base)
    with pytest.raises(ValueError, match="fp8_expert_backward"):
        cfg.TrainConfig(precision="fp8", fp8_expert_backward="fp16", **base)


def test_fp8_expert_forward_follows_precision_fp8_with_any_backward():
    base = dict(model="tiny", device="cuda", experts_backend="triton")
    assert cfg.TrainConfig(precision="fp8", **base).expert_forward_precision == "down"  # RUN_FP8_EXPERT_FORWARD
    for forward in ("gate-up", "both"):
        for backward in ("fp8", "bf16-wgrad", "bf16"):
            run = cfg.TrainConfig(precision="fp8", fp8_expert_forward=forward, fp8_expert_backward=backward, **base)
            assert run.expert_forward_precision == forward and run.expert_backward_precision == backward
    assert cfg.TrainConfig(precision="fp8", fp8_expert_forward="both", fp8_expert_backward="fp8",
                           **base).expert_forward_precision == "both"
    assert cfg.TrainConfig(precision="bf16", **base).expert_forward_precision is None
    with pytest.raises(ValueError, match="fp8_expert_forward chooses .* set precision: fp8"):
        cfg.TrainConfig(precision="bf16", fp8_expert_forward="both", **base)
    with pytest.raises(ValueError, match="fp8_expert_forward"):
        cfg.TrainConfig(precision="fp8", fp8_expert_forward="up", fp8_expert_backward="bf16", **base)


def test_fp8_emulate_needs_precision_fp8_and_the_bf16_expert_backward():
    """`fp8_emulate` (the FP8 GEMMs as quantise-dequantise images in bf16 ones, a numerics check)
    is taken with precision fp8 and fp8_expert_backward bf16, with any forward and with or without the
    dense projections; refused, with the fix, under another precision and under an FP8 expert
    backward (the default bf16-wgrad included: those kernels are not emulated)."""
    base = dict(model="tiny", device="cuda", experts_backend="triton")
    assert cfg.TrainConfig(**base).fp8_emulate is False
    for forward in ("both", "gate-up", "down"):
        for dense in (False, None):
            run = cfg.TrainConfig(precision="fp8", fp8_emulate=True, fp8_expert_backward="bf16",
                                  fp8_expert_forward=forward, fp8_dense=dense, **base)
            assert run.fp8_emulate and run.expert_forward_precision == forward
    with pytest.raises(ValueError, match="fp8_emulate: true emulates the FP8 GEMMs of precision: fp8; this run is "
                                         "precision: bf16: set precision: fp8 or remove fp8_emulate"):
        cfg.TrainConfig(precision="bf16", fp8_emulate=True, **base)
    for backward in (None, "bf16-wgrad", "fp8"):
        with pytest.raises(ValueError, match=f"fp8_expert_backward: {backward or 'bf16-wgrad'}\\) are not emulated: "
                                             "set fp8_expert_backward: bf16"):
            cfg.TrainConfig(precision="fp8", fp8_emulate=True, fp8_expert_backward=backward, **base)


def test_fp8_gluon_is_on_unless_set_false_and_needs_precision_fp8():
    """`fp8_gluon` (the FP8 experts' row and SwiGLU GEMMs in the Gluon kernels) unset is on under
    precision fp8 (`RUN_FP8_GLUON`, `expert_gluon`), false keeps the Triton ones, and nothing runs in
    Gluon without FP8 experts; true under another precision is refused with the fix."""
    base = dict(model="tiny", device="cuda", experts_backend="triton")
    assert cfg.RUN_FP8_GLUON is True
    assert cfg.TrainConfig(**base).fp8_gluon is None and not cfg.TrainConfig(**base).expert_gluon
    assert cfg.TrainConfig(precision="fp8", **base).expert_gluon is True
    assert cfg.TrainConfig(precision="fp8", fp8_gluon=True, **base).expert_gluon is True
    assert cfg.TrainConfig(precision="fp8", fp8_gluon=False, **base).expert_gluon is False
    assert cfg.TrainConfig(precision="bf16", fp8_gluon=False, **base).expert_gluon is False
    with pytest.raises(ValueError, match="fp8_gluon: true runs the FP8 experts' GEMMs in the Gluon kernels; this run "
                                         "is precision: bf16: set precision: fp8 or remove fp8_gluon"):
        cfg.TrainConfig(precision="bf16", fp8_gluon=True, **base)


def test_fp8_gluon_store_picks_the_gluon_row_gemms_epilogue_and_needs_them():
    """`fp8_gluon_store` (tma or plain) unset is `RUN_FP8_GLUON_STORE`; tma applies where the Gluon row GEMMs run
    (`expert_gluon_tma_store`), and is refused with the fix where none does; `fp8_ffn.set_gluon` takes it, at the
    128-row tiles its epilogue compiles for."""
    from disagmoe.kernels import fp8_ffn

    base = dict(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    assert cfg.RUN_FP8_GLUON_STORE == "tma" and cfg.TrainConfig(**base).expert_gluon_tma_store
    assert cfg.TrainConfig(fp8_gluon_store="tma", **base).expert_gluon_tma_store
    assert not cfg.TrainConfig(fp8_gluon_store="plain", **base).expert_gluon_tma_store
    for refused in (dict(base, fp8_gluon=False), dict(base, precision="bf16")):
        with pytest.raises(ValueError, match="fp8_gluon_store: tma chooses how the FP8 experts' Gluon row GEMMs store "
                                             "their tiles; this run has none .* remove fp8_gluon_store"):
            cfg.TrainConfig(fp8_gluon_store="tma", **refused)
    try:
        with fp8_ffn.gluon_paths(block_m=256):
            fp8_ffn.set_gluon(True, tma_store=True)
            assert (fp8_ffn._gluon.rows, fp8_ffn._gluon.tma_store, fp8_ffn._gluon.block_m) == (True, True, 128)
            fp8_ffn.set_gluon(False, tma_store=True)  # no Gluon row GEMMs: nothing stores by TMA
            assert not fp8_ffn._gluon.rows and not fp8_ffn._gluon.tma_store
    finally:
        fp8_ffn.set_gluon(False)


def test_fp8_gluon_block_m_sets_the_gluon_row_gemms_tiles_and_stores_plainly_at_256():
    """`fp8_gluon_block_m` (128 or 256, unset 128) where the Gluon row GEMMs run (`expert_gluon_block_m`, None
    where none does), refused with the fix where none does; at 256 the store defaults to plain and an explicit
    tma is refused (the TMA store takes 128-row tiles); `fp8_ffn.set_gluon` takes the tile, refusing 256 with
    the TMA store."""
    from disagmoe.kernels import fp8_ffn

    base = dict(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    assert cfg.TrainConfig(**base).expert_gluon_block_m == 128
    assert cfg.TrainConfig(precision="bf16", **{k: v for k, v in base.items() if k != "precision"}
                           ).expert_gluon_block_m is None
    wide = cfg.TrainConfig(fp8_gluon_block_m=256, **base)
    assert wide.expert_gluon_block_m == 256 and not wide.expert_gluon_tma_store
    assert not cfg.TrainConfig(fp8_gluon_block_m=256, fp8_gluon_store="plain", **base).expert_gluon_tma_store
    assert cfg.TrainConfig(fp8_gluon_block_m=128, **base).expert_gluon_tma_store == (cfg.RUN_FP8_GLUON_STORE == "tma")
    with pytest.raises(ValueError, match="fp8_gluon_block_m: 256 stores its tiles plainly .* set fp8_gluon_store: "
                                         "plain, or fp8_gluon_block_m: 128"):
        cfg.TrainConfig(fp8_gluon_block_m=256, fp8_gluon_store="tma", **base)
    with pytest.raises(ValueError, match="fp8_gluon_block_m: 256 sets the FP8 experts' Gluon row GEMMs' tiles; this "
                                         "run has none .* remove fp8_gluon_block_m"):
        cfg.TrainConfig(fp8_gluon_block_m=256, fp8_gluon=False, **base)
    with pytest.raises(ValueError, match="fp8_gluon_block_m"):  # pydantic's ValidationError is a ValueError
        cfg.TrainConfig(fp8_gluon_block_m=192, **base)
    try:
        fp8_ffn.set_gluon(True, tma_store=False, block_m=256)
        assert (fp8_ffn._gluon.rows, fp8_ffn._gluon.tma_store, fp8_ffn._gluon.block_m) == (True, False, 256)
        fp8_ffn.set_gluon(True, tma_store=True, block_m=128)
        assert (fp8_ffn._gluon.tma_store, fp8_ffn._gluon.block_m) == (True, 128)
        with pytest.raises(ValueError, match="its TMA store 128: pass tma_store=False for 256"):
            fp8_ffn.set_gluon(True, tma_store=True, block_m=256)
    finally:
        fp8_ffn.set_gluon(False, block_m=128)


def test_fp8_dense_takes_any_sequence_length():
    """The FP8 dense GEMMs have the tokens as their free dimension (the weight gradient, which
    contracted them on torch._scaled_mm and needed whole 16s, runs in bf16): any seq_len."""
    base = dict(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    assert cfg.TrainConfig(seq_len=120, fp8_dense=True, **base).dense_precision == "fp8"
    assert cfg.TrainConfig(seq_len=120, fp8_dense=False, **base).dense_precision == "bf16"


def test_the_dense_recipe_names_the_dense_projections_gemms_as_resolved():
    """`dense_recipe` (a summary's and a bench row's): precision fp8's default 'fp8 blockwise', an asked-for
    'fp8 rowwise', and the dtype where the dense projections stay out of FP8."""
    base = dict(model="tiny", device="cuda", experts_backend="triton")
    assert cfg.TrainConfig(precision="fp8", **base).dense_recipe == "fp8 blockwise"
    assert cfg.TrainConfig(precision="fp8", fp8_dense_scaling="rowwise", **base).dense_recipe == "fp8 rowwise"
    assert cfg.TrainConfig(precision="fp8", fp8_dense=False, **base).dense_recipe == "bf16"
    assert cfg.TrainConfig(precision="bf16", **base).dense_recipe == "bf16"
    assert cfg.TrainConfig(model="tiny", device="cpu", precision="fp32").dense_recipe == "fp32"


def test_colocated_pipeline_groups_need_the_same_ranks_each():
    cfg.TrainConfig(model="tiny", mode="colocated", colocated_ranks=4, pipeline_groups=2)
    with pytest.raises(ValueError, match="colocated_ranks=3 does not split evenly over pipeline_groups=2.*make "
                                         "colocated_ranks a multiple of pipeline_groups"):
        cfg.TrainConfig(model="tiny", mode="colocated", colocated_ranks=3, pipeline_groups=2)
    with pytest.raises(ValueError, match="colocated_ranks=2 does not split evenly over pipeline_groups=3"):
        cfg.TrainConfig(model="tiny", mode="colocated", colocated_ranks=2, pipeline_groups=3)
