"""Bad plugin config fails at start-up, through vLLM's own entry points, with a clear message."""

from __future__ import annotations

import pytest
from engine_utils import engine, runner_of, spec_config

import vllm_nwor.inspect
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


def test_every_vllm_speculative_key_is_left_to_vllm():
    """No key of vLLM's SpeculativeConfig is taken for a misspelling of the plugin's keys."""
    import dataclasses

    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nwor.patches.engine_args import take_plugin_keys

    vllm_keys = {f.name: object() for f in dataclasses.fields(SpeculativeConfig)}
    args = EngineArgs(model="unused", speculative_config={**vllm_keys, "nwor": True})
    take_plugin_keys(args)
    assert args.speculative_config == vllm_keys
    assert args.additional_config["nwor"] is True


def test_nwor_without_speculative_decoding_is_refused(tiny_models):
    target, _ = tiny_models
    with pytest.raises(NworConfigError, match="needs speculative decoding"), engine(
        target, None, additional_config={"nwor": True}
    ):
        pass


def test_telemetry_without_speculative_decoding_is_refused(tiny_models):
    target, _ = tiny_models
    with pytest.raises(NworConfigError, match="'nwor_telemetry': True needs speculative"), engine(
        target, None, additional_config={"nwor_telemetry": True}
    ):
        pass


def test_telemetry_switched_off_needs_nothing(tiny_models):
    target, _ = tiny_models
    with engine(target, None, additional_config={"nwor_telemetry": False}):
        pass


def test_fp8_kv_cache_is_refused_with_nwor(tiny_models):
    target, _ = tiny_models
    with pytest.raises(NworConfigError, match="kv_cache_dtype='fp8'"), engine(
        target, spec_config("ngram", nwor=True), kv_cache_dtype="fp8"
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
        assert vllm_nwor.inspect.interceptor_of(runner_of(llm)) is not None


@pytest.mark.parametrize(
    "speculative, fragment",
    [
        (spec_config("ngram", draft_context_window=64), "applies to method 'draft_model'"),
        (spec_config("draft_model", "DRAFT", draft_context_window=100_000), "allowed: 1 to 512"),
        (spec_config("draft_model", "DRAFT", draft_context_window=0), "integer >= 1"),
        (spec_config("draft_model", "DRAFT", scv="fixed", scv_chunk_size=5), "allowed: 1 to 3"),
        (spec_config("draft_model", "DRAFT", scv_chunk_size=2), "'scv' is 'off'"),
        (spec_config("draft_model", "DRAFT", scv="always"), "'off', 'fixed', 'adaptive'"),
    ],
)
def test_window_and_scv_values_are_checked(tiny_models, speculative, fragment):
    target, draft = tiny_models
    if speculative.get("model") == "DRAFT":
        speculative = {**speculative, "model": draft}
    with pytest.raises(NworConfigError, match=fragment), engine(target, speculative):
        pass


def test_an_attention_feature_nwor_cannot_serve_is_refused_naming_it(tiny_models, tmp_path):
    """A layer with a sliding window (set through the checkpoint's own config) is refused at
    start-up by the attention backend's check, with the feature, its value and the layer."""
    import json
    import shutil

    target, _ = tiny_models
    windowed = tmp_path / "windowed"
    shutil.copytree(target, windowed)
    config = json.loads((windowed / "config.json").read_text())
    config |= {"sliding_window": 8,
               "layer_types": ["sliding_attention"] * config["num_hidden_layers"]}
    (windowed / "config.json").write_text(json.dumps(config))
    with pytest.raises(NworConfigError) as err, engine(
        str(windowed), spec_config("ngram", nwor=True)
    ):
        pass
    message = str(err.value)
    for fragment in ("'nwor': true on CPU_ATTN", "sliding_window=8", "layer model.layers.0"):
        assert fragment in message, message


def test_data_parallelism_is_refused_naming_the_setting(tiny_models):
    """Refused in the front end, before any engine process starts: one scheduler per replica
    is not verified."""
    from vllm.engine.arg_utils import EngineArgs

    target, _ = tiny_models
    args = EngineArgs(model=target, skip_tokenizer_init=True, data_parallel_size=2,
                      speculative_config=spec_config("ngram", nwor=True))
    with pytest.raises(NworConfigError, match="supports data_parallel_size=1 only, got 2"):
        args.create_engine_config()


@pytest.mark.parametrize("sizes, refused", [
    ({"tensor_parallel_size": 2}, None),  # test_tensor_parallel.py, test_tensor_parallel_gpu.py
    ({"tensor_parallel_size": 1}, None),
    ({"pipeline_parallel_size": 2}, "supports pipeline_parallel_size=1 only, got 2"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
     "supports pipeline_parallel_size=1 only, got 2: not verified; allowed: 1"),
    ({"data_parallel_size": 2}, "supports data_parallel_size=1 only, got 2"),
    ({"data_parallel_size": 4, "tensor_parallel_size": 2},
     "supports data_parallel_size=1 only, got 4: not verified; allowed: 1"),
])
def test_parallelism_refused_where_not_verified(sizes, refused):
    from types import SimpleNamespace

    from vllm_nwor.patches.engine_args import unsupported_parallelism

    config = SimpleNamespace(**({"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                 "data_parallel_size": 1} | sizes))
    message = unsupported_parallelism(config)
    assert (message is None) if refused is None else (refused in message), message


@pytest.mark.parametrize("partition, splitting_ops, mode, refused", [
    (False, ["vllm::unified_attention_with_output", "vllm::unified_kv_cache_update"],
     "FULL_AND_PIECEWISE", None),  # vLLM's default on CUDA
    (True, ["vllm::unified_attention_with_output"], "FULL_AND_PIECEWISE",
     "use_inductor_graph_partition=True"),
    (False, ["vllm::unified_attention_with_output"], "PIECEWISE", "must be a splitting op"),
    (True, [], "FULL", None),  # no piecewise graphs: NWOR sees every layer or its FULL graph
    (True, [], "NONE", None),
])
def test_piecewise_graphs_that_capture_the_kv_write_are_refused(partition, splitting_ops, mode,
                                                                refused):
    from types import SimpleNamespace

    from vllm.config import CompilationMode, CUDAGraphMode

    from vllm_nwor.patches.engine_args import unsupported_compilation

    config = SimpleNamespace(mode=CompilationMode.VLLM_COMPILE,
                             use_inductor_graph_partition=partition, splitting_ops=splitting_ops,
                             cudagraph_mode=CUDAGraphMode[mode])
    message = unsupported_compilation(config)
    assert (message is None) if refused is None else (refused in message), message


RUNNER_CASES = [
    *[(method, keys, refused) for method in ("ngram", "draft_model", "eagle", "eagle3")
      for keys, refused in [({"nwor": True}, None), ({"nwor_telemetry": True}, None),
                            ({"nwor": True, "scv": "adaptive"}, None)]],
    ("draft_model", {"draft_context_window": 64}, "'draft_context_window': 64"),
    ("draft_model", {"synthetic_acceptance_per_request": True}, None),
]


@pytest.mark.parametrize("runner", ["V1", "V2"])
@pytest.mark.parametrize("method, keys, v2_refuses", RUNNER_CASES)
def test_each_runner_and_method_pair_is_served_or_refused(tiny_models, tmp_path, monkeypatch,
                                                          runner, method, keys, v2_refuses):
    """NWOR, SCV, telemetry and the benchmarks' per-request synthetic acceptance serve both of
    vLLM's runners; the draft context window needs V1. The CPU engine has no V2 runner, so
    the config is built here and then checked as vLLM would see it with
    ``VLLM_USE_V2_MODEL_RUNNER`` set (vLLM reads it whenever it is asked)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nwor.config import NworConfig
    from vllm_nwor.patches.engine_args import check_engine_config
    from vllm_nwor.testing import write_bigram_eagle_pair

    target, draft = tiny_models
    if method in ("eagle", "eagle3"):
        target, draft = write_bigram_eagle_pair(tmp_path, eagle3=method == "eagle3")
    vllm_config = EngineArgs(model=target, skip_tokenizer_init=True, max_model_len=512,
                             speculative_config=spec_config(method, draft)
                             ).create_engine_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "V2" else "0")
    assert vllm_config.use_v2_model_runner == (runner == "V2")
    config = NworConfig(**keys)
    if runner == "V1" or v2_refuses is None:
        check_engine_config(vllm_config, config)
        return
    with pytest.raises(NworConfigError) as err:
        check_engine_config(vllm_config, config)
    message = str(err.value)
    for fragment in (v2_refuses, f"speculative method {method!r} runs on the V2 runner",
                     "VLLM_USE_V2_MODEL_RUNNER=0", "leave them out on the V2 runner"):
        assert fragment in message, message
