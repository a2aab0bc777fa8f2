"""scripts/train_pair.py: the export is Hugging Face Llama, the tokenizer is bytes, runs repeat.

No vLLM here; transformers loads what the script writes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts import train_pair

REPO = Path(__file__).resolve().parents[2]

TINY = train_pair.ModelSpec("tiny", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=48, steps=3, batch_size=2, lr=1e-2, warmup=1)

TEXTS = [
    "",
    "def f(x):\n    return x  + 1\n",
    "tabs\tand\r\nCRLF\x00 nul \x7f",
    "héllo wörld ✓ 😀 日本語",
    'literal specials: "<s>" "</s>" "<pad>" <s></s>',
    "  leading and trailing spaces  ",
    " don't , . ? ! clean me up .",
]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> tuple[train_pair.Llama, Path]:
    torch.manual_seed(0)
    model = train_pair.Llama(TINY)
    with torch.no_grad():  # norms away from 1, so a mix-up of weights would show
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("export") / "tiny"
    train_pair.export(model, out)
    return model, out


def test_export_loads_as_llama_and_computes_the_same_logits(tiny_export):
    from transformers import LlamaForCausalLM

    model, out = tiny_export
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # The export is fp16: compare with the training model holding the same rounded weights.
    model.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, train_pair.VOCAB_SIZE, (2, 40), generator=generator)
    with torch.no_grad():
        expected = model.eval()(ids)
        actual = hf(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_maps_text_to_its_utf8_bytes_and_back(tiny_export, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_export[1])
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_have_the_ids_the_model_was_trained_with(tiny_export):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_export[1])
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        train_pair.BOS, train_pair.EOS, train_pair.PAD)
    assert len(tokenizer) == train_pair.VOCAB_SIZE
    assert tokenizer.decode([train_pair.BOS, 97, train_pair.EOS], skip_special_tokens=True) == "a"


def test_training_is_reproducible():
    stream = np.arange(5000, dtype=np.uint16) % 256
    windows = train_pair.eval_windows(stream, count=2, length=33)
    spec = replace(TINY, steps=4)
    first, record = train_pair.train(spec, stream, windows, torch.device("cpu"), seed=3)
    second, _ = train_pair.train(spec, stream, windows, torch.device("cpu"), seed=3)
    other, _ = train_pair.train(spec, stream, windows, torch.device("cpu"), seed=4)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    assert record["curve"][-1]["train_loss"] < record["curve"][0]["train_loss"]


def test_held_out_split_is_by_path_and_about_a_tenth():
    paths = [f"pkg{i}/module{j}.py" for i in range(40) for j in range(25)]
    held = [p for p in paths if train_pair.is_held_out(p)]
    assert 0.07 < len(held) / len(paths) < 0.13
    assert held == [p for p in paths if train_pair.is_held_out(p)]


def test_the_committed_pair_is_what_the_script_writes():
    for spec in (train_pair.TARGET, train_pair.DRAFT):
        directory = REPO / "models" / spec.name
        config = json.loads((directory / "config.json").read_text())
        assert config == train_pair.model_config(spec)
        assert json.loads((directory / "tokenizer.json").read_text()) == train_pair.tokenizer_json()
        assert json.loads((directory / "tokenizer_config.json").read_text()) == (
            train_pair.tokenizer_config())
