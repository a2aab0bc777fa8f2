"""The shipped pair (models/pystd-*) in the real CPU engine: text in, text out, real acceptance.

A trained draft agrees with its target on some bytes and not on others, and more often on
repetitive code than on novel code. With it, NWOR on and off must give the same greedy text, the
counters must match vLLM's spec-decode stats, and the acceptance must look like a real pair's:
neither all nor nothing, and different from prompt to prompt.
"""

from __future__ import annotations

import pytest
from engine_utils import engine, spec_config, spec_decode_stats
from vllm import SamplingParams

import vllm_nwor
from vllm_nwor.testing import shipped_pair

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
# Repetitive code the model can continue by copying; code unlike anything in the standard library.
REPETITIVE = "".join(f"    RESULT_{name.upper()} = {i}\n" for i, name in enumerate(
    ["ok", "error", "busy", "locked", "done", "full", "empty", "misuse"]))
NOVEL = "λx·ζ ⇒ ∮ 🐍 qu'est-ce que c'est ? ∀ε>0 ∃δ ⊢ ¬(¬p ∨ q) ⟹ 漢字 ɐɯƃᴉu"
PROBES = {"repetitive": REPETITIVE, "novel": NOVEL}
MAX_TOKENS = 48
# The pair's context is 256 tokens (max_position_embeddings).
ENGINE = dict(skip_tokenizer_init=False, max_model_len=256, max_num_batched_tokens=128)


def _run(nwor: bool) -> dict:
    target, draft = shipped_pair()
    speculative = spec_config("draft_model", draft, nwor=True) if nwor else spec_config(
        "draft_model", draft)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with engine(target, speculative, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        result = dict(
            token_ids=[list(o.outputs[0].token_ids) for o in outputs],
            text=[o.outputs[0].text for o in outputs],
            stats=spec_decode_stats(llm),
            counters=vllm_nwor.get_counters(llm),
            tokenizer=llm.get_tokenizer(),
            probes={},
        )
        for name, prompt in PROBES.items():
            before = spec_decode_stats(llm)
            llm.generate([prompt], params, use_tqdm=False)
            after = spec_decode_stats(llm)
            result["probes"][name] = (after[0] - before[0], after[1] - before[1])
        return result


@pytest.fixture(scope="module")
def runs() -> dict[bool, dict]:
    return {nwor: _run(nwor) for nwor in (False, True)}


def test_greedy_text_is_identical_with_nwor_on_and_off(runs):
    assert runs[True]["token_ids"] == runs[False]["token_ids"]
    assert runs[True]["text"] == runs[False]["text"]
    assert runs[True]["stats"] == runs[False]["stats"]
    assert runs[True]["probes"] == runs[False]["probes"]


def test_the_pair_has_both_accepted_and_rejected_drafts(runs):
    drafted, accepted = runs[True]["stats"]
    assert 0.2 < accepted / drafted < 0.9, (drafted, accepted)


def test_counters_agree_with_vllm_spec_decode_stats(runs):
    drafted, accepted = runs[True]["stats"]
    counters = runs[True]["counters"]
    assert counters.fallbacks == {}
    assert counters.tokens_staged == drafted
    assert counters.tokens_committed == accepted
    assert counters.tokens_rejected == drafted - accepted
    assert runs[False]["counters"] is None


def test_acceptance_is_higher_on_repetitive_code_than_on_novel_code(runs):
    rates = {name: accepted / drafted for name, (drafted, accepted) in runs[True]["probes"].items()}
    assert rates["repetitive"] > rates["novel"] + 0.3, rates


def test_output_text_is_the_decoded_bytes(runs):
    tokenizer = runs[True]["tokenizer"]
    for ids, text in zip(runs[True]["token_ids"], runs[True]["text"], strict=True):
        assert ids and max(ids) < 256, "a completion holds a special token"
        assert text == tokenizer.decode(ids)
        assert text == bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", PROMPTS[:2] + [REPETITIVE, NOVEL, 'x = "</s>"  # <s>\r\n'])
def test_vllm_tokenizer_round_trips_text_as_bytes(runs, text):
    tokenizer = runs[True]["tokenizer"]
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
