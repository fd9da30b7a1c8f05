"""Configs: presets load, bad input is rejected with one clear message."""

import json

import pytest
import yaml

from disagmoe import config as cfg


@pytest.mark.parametrize("name", cfg.preset_names("models"))
def test_model_presets_load_and_round_trip(name):
    m = cfg.load_model(name)
    again = cfg.ModelConfig.model_validate(yaml.safe_load(m.to_yaml()))
    assert again == m


@pytest.mark.parametrize("name", cfg.preset_names("hardware"))
def test_hardware_presets_load(name):
    h = cfg.load_hardware(name)
    assert h.name == name and h.nvlink_domain in (8, 72)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as err:
        cfg.load_model("mixtral-8x8b")
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
        cfg.load_model(str(path))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        cfg.load_model(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        cfg.load_model(str(bad))


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
