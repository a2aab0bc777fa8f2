"""Config keys: validation and error messages (no vLLM needed)."""

import pytest

from vllm_nwor.config import (
    NworConfig,
    NworConfigError,
    config_from_additional,
    looks_like_plugin_key,
    merge_plugin_settings,
    split_plugin_keys,
)


def test_defaults_leave_everything_off():
    assert NworConfig() == NworConfig.from_dict({})
    assert not NworConfig().enabled


def test_nwor_true_enables():
    config = NworConfig.from_dict({"nwor": True})
    assert config.nwor and config.enabled


@pytest.mark.parametrize("value", ["true", 1, 0, None, "yes", [True]])
def test_non_bool_nwor_names_key_value_and_allowed(value):
    with pytest.raises(NworConfigError) as err:
        NworConfig.from_dict({"nwor": value}, where="speculative_config")
    message = str(err.value)
    assert "'nwor'" in message and repr(value) in message and "true or false" in message
    assert "speculative_config" in message


@pytest.mark.parametrize("typo", ["nwr", "nowr", "nwor_enable", "NWOR", "nwor-mode"])
def test_misspelled_key_is_claimed_and_refused_with_a_suggestion(typo):
    ours, rest = split_plugin_keys({typo: True, "method": "ngram"})
    assert rest == {"method": "ngram"}
    with pytest.raises(NworConfigError) as err:
        NworConfig.from_dict(ours, where="speculative_config")
    message = str(err.value)
    assert typo.replace("-", "_") in message and "True" in message and "nwor" in message


@pytest.mark.parametrize("key", ["method", "model", "num_speculative_tokens", "prompt_lookup_max",
                                 "draft_tensor_parallel_size", "gdn_prefill_backend"])
def test_vllm_keys_are_left_to_vllm(key):
    assert not looks_like_plugin_key(key)


def test_host_keys_are_never_claimed_as_near_misses():
    # vLLM's own synthetic-acceptance keys are close to 'synthetic_acceptance_per_request'.
    raw = {"synthetic_acceptance_length": 2.5, "synthetic_acceptance_rates": [1.0], "nwor": True}
    host = {"synthetic_acceptance_length", "synthetic_acceptance_rates"}
    ours, rest = split_plugin_keys(raw, host)
    assert ours == {"nwor": True}
    assert rest == {"synthetic_acceptance_length": 2.5, "synthetic_acceptance_rates": [1.0]}


def test_dashes_are_normalised_like_vllm_does():
    ours, _ = split_plugin_keys({"nwor": True})
    assert ours == {"nwor": True}


def test_same_key_with_two_values_is_refused():
    with pytest.raises(NworConfigError, match="set twice"):
        merge_plugin_settings({"nwor": True}, {"nwor": False})
    assert merge_plugin_settings({"nwor": True}, {"nwor": True}) == {"nwor": True}


def test_read_back_from_additional_config_ignores_other_plugins_keys():
    assert config_from_additional({"nwor": True, "other_plugin": 3}).nwor
    assert not config_from_additional({}).enabled
    assert not config_from_additional(None).enabled


@pytest.mark.parametrize(
    "feature",
    [{"nwor": True}, {"scv": "adaptive"}, {"scv": "fixed"}, {"draft_context_window": 64},
     {"synthetic_acceptance_per_request": True}],
)
def test_telemetry_follows_the_other_features_unless_set(feature):
    assert NworConfig.from_dict(feature).telemetry
    assert not NworConfig.from_dict({**feature, "nwor_telemetry": False}).telemetry
    assert NworConfig.from_dict({**feature, "nwor_telemetry": False}).enabled


def test_telemetry_follows_nwor_unless_set():
    assert not NworConfig().telemetry
    assert not NworConfig.from_dict({"scv": "off"}).telemetry
    assert NworConfig.from_dict({"nwor": True}).telemetry
    assert not NworConfig.from_dict({"nwor": True, "nwor_telemetry": False}).telemetry
    on_alone = NworConfig.from_dict({"nwor_telemetry": True})
    assert on_alone.telemetry and on_alone.enabled and not on_alone.nwor
    assert NworConfig.from_dict({"nwor_telemetry": None}) == NworConfig()


@pytest.mark.parametrize("value", ["true", 1, "off", [False]])
def test_bad_telemetry_value_names_key_value_and_allowed(value):
    with pytest.raises(NworConfigError) as err:
        NworConfig.from_dict({"nwor_telemetry": value}, where="additional_config")
    message = str(err.value)
    assert "'nwor_telemetry'" in message and repr(value) in message
    assert "true, false or null" in message and "additional_config" in message


def test_telemetry_key_is_claimed_from_the_speculative_config():
    ours, rest = split_plugin_keys({"method": "ngram", "nwor-telemetry": True})
    assert ours == {"nwor_telemetry": True} and rest == {"method": "ngram"}


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, "0.1", True, None])
def test_probe_cost_is_a_share_of_engine_time(value):
    with pytest.raises(NworConfigError) as err:
        NworConfig.from_dict({"scv_probe_cost": value}, where="speculative_config")
    message = str(err.value)
    assert "'scv_probe_cost'" in message and repr(value) in message and "<= 1" in message


@pytest.mark.parametrize("value", [1, 0.5, 0.001])
def test_probe_cost_accepts_shares(value):
    assert NworConfig.from_dict({"scv_probe_cost": value}).scv_probe_cost == value
