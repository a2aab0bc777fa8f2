"""The shipped pair (models/pystd-*) in the real CPU engine: text in, text out, real acceptance.

A trained draft agrees with its target on some bytes and not on others, and more often on
repetitive code than on novel code. With it, every mode (plugin off, NWOR, NWOR with SCV, SCV
alone) must give the same greedy text; NWOR must change no acceptance and its counters must match
vLLM's spec-decode stats; the acceptance must look like a real pair's (neither all nor nothing,
different from request to request); and SCV must give requests that accept differently different
chunks.

Per-request chunk sizes and acceptance lengths are vLLM's own scheduler counts
(``vllm_nwor.testing.SpecStepRecorder``); the plugin's telemetry (``acceptance_lengths`` on each
output, on whenever a plugin feature is) must report exactly those.
"""

from __future__ import annotations

import statistics

import pytest
from engine_utils import assert_counters_agree, engine, spec_config, spec_decode_stats
from vllm import SamplingParams

import vllm_nwor
from vllm_nwor.testing import SpecStepRecorder, shipped_pair

# Text prompts of mixed lengths (bytes = tokens). The longest exceed max_num_batched_tokens, so
# they are prefilled in chunks beside other requests' verify steps.
PROMPTS = [
    "import os\n",
    "def read_config(path):\n    ",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    'if __name__ == "__main__":\n',
    "    for i, item in enumerate(items):\n        if item is None:\n            continue\n",
    '"""Utilities for parsing and formatting dates.\n\nThe functions in this module accept\n',
    "try:\n    import _json\nexcept ImportError:\n    _json = None\n\n\ndef dumps(obj, *, "
    "skipkeys=False, ensure_ascii=True,\n          check_circular=True, allow_nan=True):\n"
    '    """Serialize ``obj`` to a JSON formatted ``str``.\n',
    "def _check(value):\n    if not isinstance(value, int):\n        raise TypeError(",
]
# Requests whose drafts the pair accepts very differently, generated together in one batch after
# PROMPTS. After a table of constants the target writes a run of spaces, which the draft predicts
# every time; after text unlike anything in the standard library it writes a sentence-like string
# the draft half predicts; after this class header it falls into `self._state_state_state...`, a
# loop the draft misses about five bytes in six (see docs/model_pair.md).
REPETITIVE = "".join(f"    RESULT_{name.upper()} = {i}\n" for i, name in enumerate(
    ["ok", "error", "busy", "locked", "done", "full", "empty", "misuse"]))
NOVEL = "λx·ζ ⇒ ∮ 🐍 qu'est-ce que c'est ? ∀ε>0 ∃δ ⊢ ¬(¬p ∨ q) ⟹ 漢字 ɐɯƃᴉu"
LOOPING = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
MAIN = 'if __name__ == "__main__":\n'  # also followed by spaces
PROBES = [REPETITIVE, NOVEL, LOOPING, MAIN]
# The requests that always accept get more tokens, so that they run as long as the others.
PROBE_TOKENS = [80, 48, 48, 160]
MAX_TOKENS = 48
K = 3
# The pair's context is 256 tokens (max_position_embeddings).
ENGINE = dict(skip_tokenizer_init=False, max_model_len=256, max_num_batched_tokens=128,
              max_num_seqs=8)
# SCV with its step-cost model pinned to a compute-bound engine (10 ms a step, 0.5 ms per
# verified token, 0.05 ms per draft, as in test_scv_engine.py): there, a draft is worth
# verifying only when it is likely to be accepted, so requests that accept differently should
# get different chunks. (Fitted online on this CPU the cost is mostly fixed per step, and the
# batch's one draft budget decides every chunk: see the demo.)
SCV_COMPUTE_BOUND = {"scv": "adaptive", "scv_cost_model": [0.01, 5e-4, 5e-5]}
MODES = {
    "off": {},
    "nwor": {"nwor": True},
    "nwor+scv": {"nwor": True, "scv": "adaptive"},
    "scv": SCV_COMPUTE_BOUND,
}


def _run(keys: dict) -> dict:
    target, draft = shipped_pair()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with engine(target, spec_config("draft_model", draft, k=K, **keys), **ENGINE) as llm:
        recorder = SpecStepRecorder(llm)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = spec_decode_stats(llm)
        steps = recorder.take(outputs)
        probes = llm.generate(PROBES, [SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True) for n in PROBE_TOKENS], use_tqdm=False)
        probe_steps = recorder.take(probes)
        return dict(
            token_ids=[list(o.outputs[0].token_ids) for o in outputs + probes],
            lengths=[getattr(o.outputs[0].spec_decode_metrics, "per_step_accepted", None)
                     for o in outputs + probes],
            text=[o.outputs[0].text for o in outputs + probes],
            stats=stats,
            steps=steps,
            probe_steps=probe_steps,
            counters=vllm_nwor.get_counters(llm),
            total_stats=spec_decode_stats(llm),
            tokenizer=llm.get_tokenizer(),
        )


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {name: _run(keys) for name, keys in MODES.items()}


def _rate(steps) -> float:
    return sum(steps.accepted) / sum(steps.chunks)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "off"])
def test_greedy_text_is_identical_in_every_mode(runs, mode):
    assert runs[mode]["token_ids"] == runs["off"]["token_ids"]
    assert runs[mode]["text"] == runs["off"]["text"]


def test_nwor_changes_no_acceptance(runs):
    assert runs["nwor"]["stats"] == runs["off"]["stats"]
    for name in ("steps", "probe_steps"):
        assert runs["nwor"][name] == runs["off"][name]


def test_the_pair_has_both_accepted_and_rejected_drafts(runs):
    drafted, accepted = runs["off"]["stats"]
    assert 0.2 < accepted / drafted < 0.9, (drafted, accepted)
    lengths = [length for steps in runs["off"]["steps"] for length in steps.accepted]
    assert set(lengths) == set(range(K + 1))  # every acceptance length occurs


@pytest.mark.parametrize("mode", ["nwor", "nwor+scv"])
def test_counters_agree_with_vllm_spec_decode_stats(runs, mode):
    drafted, accepted = runs[mode]["total_stats"]
    counters = runs[mode]["counters"]
    assert_counters_agree(counters, drafted, accepted)
    assert runs["off"]["counters"] is None


def test_recorded_steps_add_up_to_vllm_spec_decode_stats(runs):
    for run in runs.values():
        steps = run["steps"]
        assert (sum(sum(s.chunks) for s in steps), sum(sum(s.accepted) for s in steps)) == \
            run["stats"]
        for s in steps:
            chunks = [c for c in s.chunks if c]
            assert all(0 <= a <= c for a, c in zip(s.accepted, chunks, strict=True))


@pytest.mark.parametrize("mode", [m for m in MODES if m != "off"])
def test_telemetry_reports_each_requests_acceptance_lengths(runs, mode):
    run = runs[mode]
    assert run["lengths"] == [s.accepted for s in run["steps"] + run["probe_steps"]]
    assert all(lengths is None for lengths in runs["off"]["lengths"])


def test_acceptance_differs_from_request_to_request(runs):
    rates = repetitive, novel, looping, main = [_rate(s) for s in runs["off"]["probe_steps"]]
    assert min(repetitive, main) > 0.9 and looping < 0.3, rates
    assert looping + 0.2 < novel < repetitive - 0.2, rates


def test_scv_gives_requests_that_accept_differently_different_chunks(runs):
    """In one batch, the requests whose drafts are always accepted keep verifying full chunks,
    while the looping one, whose drafts fail once its loop starts, verifies fewer."""
    off, scv = runs["off"]["probe_steps"], runs["scv"]["probe_steps"]
    repetitive, _, looping, main = scv
    # Without SCV every request verifies K drafts in every step.
    assert {c for s in off for c in s.chunks} == {K}
    # With it, the always-accepting requests still do (after the first steps, from the prior)...
    for steps in (repetitive, main):
        assert statistics.fmean(steps.chunks[2:]) >= 2.5, steps
    # ...while the looping request, in the second half of its steps (its loop began in the
    # first few), verifies at most about one draft a step...
    late = looping.chunks[len(looping.chunks) // 2:]
    assert statistics.fmean(late) <= 1.25, looping
    # ...and so drafts far fewer tokens in all than without SCV, where the others do not. (Not
    # none: valued in steady state, a slow request's tokens free more slot time, so at an
    # acceptance near 0.3 it keeps one draft where a next-step valuation gave it none; 60 of
    # 96 drafts on 2026-11-23, against 96 without SCV.)
    drafted = [(sum(a.chunks), sum(b.chunks)) for a, b in zip(off, scv, strict=True)]
    assert drafted[2][1] < 0.7 * drafted[2][0], drafted
    assert drafted[0][1] >= 0.9 * drafted[0][0] and drafted[3][1] >= 0.9 * drafted[3][0], drafted


def test_output_text_is_the_decoded_bytes(runs):
    tokenizer = runs["off"]["tokenizer"]
    for ids, text in zip(runs["off"]["token_ids"], runs["off"]["text"], strict=True):
        assert ids and max(ids) < 256, "a completion holds a special token"
        assert text == tokenizer.decode(ids)
        assert text == bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", PROMPTS[:2] + [REPETITIVE, NOVEL, 'x = "</s>"  # <s>\r\n'])
def test_vllm_tokenizer_round_trips_text_as_bytes(runs, text):
    tokenizer = runs["off"]["tokenizer"]
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
