"""`disagmoe.compact`: the same values as the block style, lists of numbers on one line."""

import json

import yaml

from disagmoe import compact

DATA = {"name": "x", "expert_map": [[[0], [1, 2]], [[3], [0]]], "empty": [], "none": {},
        "stages": [{"name": "a, b (fwd)", "time_s": 1e-7}, {"name": "c", "time_s": 2.5}],
        "notes": ["a sentence, with: punctuation", "another"], "nested": {"k": [1, 2, 3], "m": {"q": None}}}


def test_json_and_yaml_read_back_the_same_values():
    assert json.loads(compact.to_json(DATA)) == DATA
    assert yaml.safe_load(compact.to_yaml(DATA)) == DATA


def test_lists_of_numbers_and_scalar_mappings_in_lists_take_one_line_strings_do_not():
    for text in (compact.to_json(DATA), compact.to_yaml(DATA)):
        lines = text.splitlines()
        assert sum("[[0], [1, 2]]" in line for line in lines) == 1
        assert sum("time_s" in line for line in lines) == 2  # a stage per line
        assert not any("another" in line and "punctuation" in line for line in lines)  # a note per line
