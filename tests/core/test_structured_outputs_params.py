"""``StructuredOutputsParams`` and its place in ``SamplingParams``: checked, frozen, hashable (no torch)."""

import pytest

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.core.structured_outputs import StructuredOutputsParams as S
from minicb.core.structured_outputs import schema_depth


def test_exactly_one_constraint():
    for kwargs in ({}, {"regex": "a", "choice": ["x"]}, {"json": {}, "json_object": True}):
        with pytest.raises(InvalidArgument, match="exactly one"):
            S(**kwargs)
    assert [S(json={}).kind, S(regex="a").kind, S(choice=["a"]).kind, S(grammar="start: a").kind,
            S(json_object=True).kind] == ["json", "regex", "choice", "grammar", "json_object"]


def test_a_schema_dict_becomes_its_json_text_in_key_order_so_params_hash():
    a = S(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.json == '{"type":"object","properties":{"b":{},"a":{}}}'     # property order kept
    assert a == S(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    p = SamplingParams(structured_outputs=a)
    assert hash(p) == hash(SamplingParams(structured_outputs=S(json=a.json))) and p.structured_outputs == a
    assert S(choice=["x", "y"]).choice == ("x", "y")


@pytest.mark.parametrize("kwargs, needle", [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": 7}, "must be a JSON schema"),
    ({"json": {"x": float("nan")}}, "not a JSON value"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": 3}, "non-empty string"),
    ({"choice": "ab"}, "non-empty list"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty list"),
    ({"json_object": 1}, "must be a bool"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, needle):
    with pytest.raises(InvalidArgument, match=needle):
        S(**kwargs)


def test_sampling_params_checks_the_type_and_refuses_ignore_eos():
    with pytest.raises(InvalidArgument, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        SamplingParams(structured_outputs=S(regex="a"), ignore_eos=True)
    assert SamplingParams().structured_outputs is None


def test_schema_depth_counts_container_levels_without_recursing():
    values = (1, "s", {}, [], {"a": [1]}, {"a": {"b": {"c": {}}}})
    assert [schema_depth(x) for x in values] == [0, 0, 1, 1, 2, 4]
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert schema_depth(deep) == 5001


def test_size_is_the_constraints_characters():
    assert (S(regex="abc").size, S(choice=["ab", "c"]).size, S(json_object=True).size) == (3, 3, 0)
