"""Bad plugin config fails at start-up, through vLLM's own entry points, with a clear message."""

from __future__ import annotations

import pytest
from engine_utils import engine, runner_of, spec_config

from vllm_nwor import NworConfigError


@pytest.mark.parametrize(
    "speculative, additional, expected",
    [
        ({"nwr": True}, None, ["'nwr'", "True", "did you mean 'nwor'"]),
        ({"nwor": "yes"}, None, ["'nwor'", "'yes'", "true or false"]),
        ({}, {"nwor": 1}, ["additional_config", "'nwor'", "1", "true or false"]),
        ({}, {"nwor_mode": "on"}, ["additional_config", "'nwor_mode'", "'on'", "nwor"]),
        ({"nwor": True}, {"nwor": False}, ["set twice", "True", "False"]),
        ({"nwor_telemetry": "yes"}, None, ["'nwor_telemetry'", "'yes'", "true, false or null"]),
    ],
)
def test_bad_keys_and_values_fail_with_key_value_and_allowed(
    tiny_models, speculative, additional, expected
):
    target, _ = tiny_models
    kwargs = {"additional_config": additional} if additional is not None else {}
    with pytest.raises(NworConfigError) as err, engine(
        target, spec_config("ngram", **speculative), **kwargs
    ):
        pass
    for fragment in expected:
        assert fragment in str(err.value)


def test_nwor_without_speculative_decoding_is_refused(tiny_models):
    target, _ = tiny_models
    with pytest.raises(NworConfigError, match="needs speculative decoding"), engine(
        target, None, additional_config={"nwor": True}
    ):
        pass


def test_telemetry_without_speculative_decoding_is_refused(tiny_models):
    target, _ = tiny_models
    with pytest.raises(NworConfigError, match="'nwor_telemetry': true needs speculative"), engine(
        target, None, additional_config={"nwor_telemetry": True}
    ):
        pass


def test_unknown_vllm_keys_are_still_vllms_to_reject(tiny_models):
    target, _ = tiny_models
    with pytest.raises(Exception) as err, engine(target, spec_config("ngram", bogus_key=1)):
        pass
    assert not isinstance(err.value, NworConfigError)
    assert "bogus_key" in str(err.value)


def test_additional_config_switches_nwor_on_too(tiny_models):
    target, _ = tiny_models
    with engine(target, spec_config("ngram"), additional_config={"nwor": True}) as llm:
        assert runner_of(llm)._nwor_interceptor is not None
