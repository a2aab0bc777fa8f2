"""Model checkpoints for tests, demos and benchmarks.

No machine here can reach a model hub.

- ``shipped_pair`` locates the trained byte-level target/draft pair committed under ``models/``
  (written by ``scripts/train_pair.py``; see docs/model_pair.md). Its draft agrees with its
  target sometimes and not at other times, more often on repetitive code than on novel code.
- ``write_tiny_llama_pair`` writes tiny random-weight Llamas on the spot. Weights are drawn with
  a larger spread than vLLM's ``load_format="dummy"`` (whose tiny uniform values make greedy
  decoding loop within a few tokens and almost never reject a draft). The draft model is the
  target's first layers with the target's embeddings and head, plus optional noise, so it agrees
  with the target sometimes and not at other times: drafts are accepted and rejected.
- ``held_out_prompt_ids`` and ``long_run_pair`` set the pair up for generations far past its 256
  trained positions (docs/draft_window.md).
- ``write_bigram_eagle_pair`` writes a target and an EAGLE (or EAGLE-3) head for it on the
  spot, built so that EAGLE drafts are accepted sometimes and rejected at other times.
- ``PAIR_DEMO_*`` and ``pair_demo_engine_args``: ``make demo``'s workload on the shipped pair;
  ``pair_demo_throughput`` times it for several plugin settings at once, the engines taking
  turns step by step (``make demo`` and ``benchmarks/nwor_cpu.py``), and ``geomean_interval``
  gives a ratio's geometric mean over rounds with its 95% interval.
- ``SpecStepRecorder`` records each request's chunk sizes and acceptance lengths from an
  in-process engine's scheduler.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHIPPED_TARGET = "pystd-target"
SHIPPED_DRAFT = "pystd-draft"


def shipped_pair(models_dir: str | Path | None = None) -> tuple[str, str]:
    """Absolute paths of the committed (target, draft) pair, ``models/pystd-{target,draft}``.

    The pair lives in the source checkout, not in an installed wheel; ``models_dir`` points
    elsewhere (for example at a fresh ``scripts/train_pair.py --out DIR``).
    """
    root = Path(models_dir) if models_dir else Path(__file__).resolve().parents[2] / "models"
    paths = (root / SHIPPED_TARGET, root / SHIPPED_DRAFT)
    for path in paths:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"no model at {path}: the shipped pair is in the source checkout's models/ "
                "directory (scripts/train_pair.py writes it)"
            )
    return str(paths[0]), str(paths[1])


PAIR_DEMO_K = 3
PAIR_DEMO_MAX_TOKENS = 96
PAIR_DEMO_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    '    STATUS_OK = 0\n    STATUS_ERROR = 1\n    STATUS_BUSY = 2\n    STATUS_LOCKED = 3\n',
    'def parse_header(line):\n    """Parse a Content-Type like header.\n\n    Return the main ',
    "    try:\n        with open(filename, 'rb') as f:\n            data = f.read()\n    except ",
    "# Copyright 2026. Naïve façade: ünïcödé in comments ✓\nλ = lambda ζ: ζ ** 2\n",
]
"""``make demo``'s prompts: code the pair has seen the like of, and some it has not."""


def pair_demo_engine_args(target: str, draft: str, plugin_keys: dict) -> dict:
    """``make demo``'s ``LLM`` arguments: draft_model speculation with k = ``PAIR_DEMO_K`` and
    the plugin's ``plugin_keys`` (none: vLLM alone). max_model_len is the pair's context, 256
    tokens (bytes)."""
    speculative = {"method": "draft_model", "model": draft,
                   "num_speculative_tokens": PAIR_DEMO_K, **plugin_keys}
    return dict(model=target, dtype="float32", block_size=32, max_num_seqs=8,
                max_num_batched_tokens=256, enforce_eager=True, gpu_memory_utilization=0.3,
                disable_log_stats=False, seed=0, speculative_config=speculative)


def pair_demo_throughput(modes: dict[str, dict], rounds: int) -> dict:
    """Tokens per second of ``make demo``'s workload with each of ``modes`` (a name and its
    plugin keys; none: vLLM alone), every mode's engine in this process at once.

    Each round gives every engine the demo's requests and then steps the engines in turn, one
    engine step each, until all are done, timing each engine's own steps; the order turns round
    by round. Taking turns step by step puts every engine in the same seconds of the host, so a
    slow spell (another tenant on a shared machine) slows them alike, and a ratio of two modes'
    throughput in one round is a fair one. Returns ``tok_s`` (per mode, one per round),
    ``over_first`` (each other mode's throughput over the first mode's, round by round:
    :func:`geomean_interval`) and whether every engine's greedy tokens were the same in every
    round."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every engine core in this process
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=PAIR_DEMO_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    target, draft = shipped_pair()
    engines: dict = {}
    names = list(modes)
    tok_s: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list] = {name: [] for name in names}
    try:
        for name in names:  # one at a time: each sizes its KV cache at start-up
            llm = LLM(**pair_demo_engine_args(target, draft, modes[name]))
            engines[name] = llm.llm_engine
            llm.generate(PAIR_DEMO_PROMPTS, params, use_tqdm=False)  # the demo's warm-up
        for rnd in range(rounds):
            seconds = dict.fromkeys(names, 0.0)
            done: dict[str, dict[str, list[int]]] = {name: {} for name in names}
            for name in names:
                for i, prompt in enumerate(PAIR_DEMO_PROMPTS):
                    engines[name].add_request(f"{rnd}-{i}", prompt, params)
            shift = rnd % len(names)
            running = names[shift:] + names[:shift]
            while running:
                for name in list(running):
                    start = time.perf_counter()
                    outputs = engines[name].step()
                    seconds[name] += time.perf_counter() - start
                    for output in outputs:
                        if output.finished:
                            done[name][output.request_id] = list(output.outputs[0].token_ids)
                    if not engines[name].has_unfinished_requests():
                        running.remove(name)
            for name in names:
                ids = [done[name][f"{rnd}-{i}"] for i in range(len(PAIR_DEMO_PROMPTS))]
                tok_s[name].append(round(sum(map(len, ids)) / seconds[name], 1))
                tokens[name].append(ids)
    finally:
        for engine in engines.values():
            engine.engine_core.shutdown()
    base, first = tok_s[names[0]], tokens[names[0]][0]
    return {"tok_s": tok_s,
            "over_first": {name: geomean_interval([a / b for a, b in zip(tok_s[name], base,
                                                                        strict=True)])
                           for name in names[1:]},
            "greedy_tokens_equal": all(t == first for ts in tokens.values() for t in ts)}


T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 15: 2.13, 20: 2.09, 30: 2.04}
"""Student's t, 97.5% quantile, by degrees of freedom (a df between keys takes the smaller
key's, the wider interval; scipy is not among vLLM's requirements)."""


def geomean_interval(ratios: list[float]) -> dict:
    """The geometric mean of ``ratios`` and its 95% interval (Student's t on the logs)."""
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    half *= T_975[max(df for df in T_975 if df <= len(logs) - 1)]
    return {"geomean": round(math.exp(mean), 4),
            "interval_95": [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)]}


def write_tiny_llama_pair(
    root: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 3,
    draft_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    init_std: float = 0.05,
    draft_noise: float = 0.0,
    max_position_embeddings: int = 2048,
    draft_max_position_embeddings: int | None = None,
    seed: int = 0,
) -> tuple[str, str]:
    """Writes ``root/target`` and ``root/draft`` (config.json + safetensors); returns both paths.

    No tokenizer is written: use ``skip_tokenizer_init=True`` and token-id prompts.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(root)
    target_dir, draft_dir = root / "target", root / "draft"
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(target_dir)

    from safetensors.torch import load_file

    weights = load_file(target_dir / "model.safetensors")
    keep = {f"model.layers.{i}." for i in range(draft_layers)}
    generator = torch.Generator().manual_seed(seed + 1)
    draft = {
        name: tensor + draft_noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
        for name, tensor in weights.items()
        if ".layers." not in name or any(name.startswith(prefix) for prefix in keep)
    }
    draft_dir.mkdir(parents=True, exist_ok=True)
    save_file(draft, draft_dir / "model.safetensors", metadata={"format": "pt"})
    draft_config = json.loads((target_dir / "config.json").read_text())
    draft_config["num_hidden_layers"] = draft_layers
    if draft_max_position_embeddings is not None:
        draft_config["max_position_embeddings"] = draft_max_position_embeddings
    (draft_dir / "config.json").write_text(json.dumps(draft_config, indent=2))
    return str(target_dir), str(draft_dir)


def held_out_prompt_ids(count: int, size: int = 128) -> list[list[int]]:
    """Byte-token prompts of ``size`` bytes from ``count`` of the pair's held-out files.

    The held-out files are those ``scripts/train_pair.py`` keeps out of training (SHA-256 of the
    path relative to the standard library, 0 mod 10); each prompt starts 40% into its file.
    """
    import hashlib
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "test", "tests"} & set(rel.parts[:-1]):
            continue
        if int.from_bytes(hashlib.sha256(rel.as_posix().encode()).digest()[:8], "big") % 10:
            continue
        data = path.read_bytes()
        if len(data) >= 4 * size:
            start = int(0.4 * len(data))
            prompts.append(list(data[start : start + size]))
        if len(prompts) == count:
            return prompts
    raise FileNotFoundError(f"fewer than {count} held-out files of {4 * size} bytes in {root}")


def long_run_pair(root: str | Path, window: int = 256) -> tuple[str, str, str]:
    """The shipped pair set up for generations far longer than its 256 trained positions.

    Returns (target, draft, draft_full): the target with a ``window``-token sliding window on
    every layer and 4,096 positions, so it stays within what it was trained on however long it
    runs; the draft as shipped (256 positions); and the draft told it has 4,096 positions, so
    vLLM drafts with it over the whole sequence.
    """
    target, draft = shipped_pair()
    root = Path(root)

    def copy(source: str, name: str, **config_changes) -> str:
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        for item in Path(source).iterdir():
            (out / item.name).write_bytes(item.read_bytes())
        config = json.loads((out / "config.json").read_text())
        config.update(config_changes)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return str(out)

    layers = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
    long_target = copy(target, "target-sliding", max_position_embeddings=4096,
                       sliding_window=window, layer_types=["sliding_attention"] * layers)
    return long_target, draft, copy(draft, "draft-4096", max_position_embeddings=4096)

@dataclass
class RequestSteps:
    """One request's decode steps, as the scheduler saw them."""

    chunks: list[int] = field(default_factory=list)
    """Drafts verified in each decode step; 0 where the request decoded without drafts."""
    accepted: list[int] = field(default_factory=list)
    """Drafts accepted in each speculative step (a decode step with drafts): the request's
    acceptance lengths."""


class SpecStepRecorder:
    """Each request's chunk sizes and acceptance lengths, read from an in-process scheduler.

    Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and vLLM's
    stats on (``disable_log_stats=False``). It wraps two methods of the scheduler instance:
    ``schedule``, for the drafts each decode step verifies per request (0 where SCV chose plain
    decoding), and ``make_spec_decoding_stats``, which vLLM calls once per request and
    speculative step with the numbers it adds to ``vllm:spec_decode_num_draft_tokens`` and
    ``vllm:spec_decode_num_accepted_tokens``. So the acceptance lengths are vLLM's own counts.
    """

    def __init__(self, llm) -> None:
        from vllm_nwor.inspect import scheduler_of

        scheduler = scheduler_of(llm)
        self._steps: dict[str, RequestSteps] = defaultdict(RequestSteps)
        schedule, make_stats = scheduler.schedule, scheduler.make_spec_decoding_stats

        def recording_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            for req_id, scheduled in out.num_scheduled_tokens.items():
                request = scheduler.requests[req_id]
                # num_computed_tokens already counts this step's tokens: decode steps only.
                if request.num_computed_tokens - scheduled >= request.num_prompt_tokens:
                    drafts = out.scheduled_spec_decode_tokens.get(req_id, ())
                    self._steps[req_id].chunks.append(len(drafts))
            return out

        def recording_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                            num_invalid_spec_tokens, request_id):
            if num_draft_tokens:
                self._steps[request_id].accepted.append(num_accepted_tokens)
            return make_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                              num_invalid_spec_tokens, request_id)

        scheduler.schedule = recording_schedule
        scheduler.make_spec_decoding_stats = recording_stats

    def take(self, outputs=()) -> list[RequestSteps]:
        """The steps of ``outputs``' requests (``RequestOutput`` list), in their order, and
        forget everything recorded so far."""
        # The engine's request id is the caller's plus "-" and 8 random characters (unless
        # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set).
        steps, self._steps = self._steps, defaultdict(RequestSteps)
        by_caller_id = {req_id[:-9]: s for req_id, s in steps.items() if req_id[-9:-8] == "-"}
        return [steps.get(o.request_id) or by_caller_id.get(o.request_id) or RequestSteps()
                for o in outputs]


def write_mimo_mtp_config(root: str | Path, *, hidden_size: int = 256, num_heads: int = 4,
                          num_kv_heads: int = 2, num_layers: int = 2,
                          vocab_size: int = 512) -> str:
    """Writes the config of a tiny MiMo model (``MiMoForCausalLM``: a Qwen2 decoder with one MTP
    layer); returns its directory. Load it with ``load_format="dummy"`` and draft with
    ``{"method": "mtp"}``. MiMo was the dense model with an MTP layer that vLLM 0.26 ran on its
    V2 runner with FLASH_ATTN (its other MTP models were MoE, hybrid, MLA or multimodal)."""
    target = Path(root) / "mimo"
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": hidden_size // num_heads,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "use_sliding_window": False,
        "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)


def write_bigram_eagle_pair(root: str | Path, *, noise: float = 0.03, seed: int = 0,
                            eagle3: bool = False, hidden_size: int = 128, num_heads: int = 4,
                            num_kv_heads: int = 2) -> tuple[str, str]:
    """Writes a target whose next token depends on the current token only, and an EAGLE head
    for it; returns ``(target, head)``.

    The target is a random tiny Llama (vocab 512, 3 layers; by default hidden 128, head dim 32,
    GQA 2; FlashAttention on a GPU wants head dims of 64 or more) with every ``o_proj`` and
    ``down_proj`` zeroed: each layer passes its input through, so the logits are a function of
    the current token's embedding. The EAGLE-1 head's ``fc`` maps ``[embedding, hidden]`` to the
    embedding (plus ``noise``), and its layer is the target's first (the identity too): with
    ``noise`` 0 it drafts what the target will say, and with 0.03 it is right about one time in
    six on the default shape (real rejections, greedy, no synthetic acceptance).

    With ``eagle3``, the head is an EAGLE-3 head (``LlamaForCausalLMEagle3``) for the same
    target. EAGLE-3 sees the next token's embedding only through its attention, so this head
    ignores it: ``fc`` passes the target's hidden state of the current token through, its
    attention and MLP add nothing, and its own ``lm_head`` maps that token to the one the target
    says two steps later (plus ``noise``, scaled to the width). Its first draft is the target's
    token unless the noise says otherwise; its later drafts repeat the first, so they are right
    only where the target repeats a token. Real partial acceptance, greedy.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(root)
    target_dir, head_dir = root / "target", root / ("eagle3" if eagle3 else "eagle")
    torch.manual_seed(seed)
    hidden = hidden_size
    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden // num_heads, max_position_embeddings=2048,
        initializer_range=0.5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    model.load_state_dict(weights)
    model.save_pretrained(target_dir)
    head_dir.mkdir(parents=True, exist_ok=True)
    head_config = json.loads((target_dir / "config.json").read_text())
    head_config["num_hidden_layers"] = 1
    if eagle3:
        head_config |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 512}
        generator = torch.Generator().manual_seed(seed + 1)
        layer = {name.removeprefix("model.layers.0."): tensor
                 for name, tensor in weights.items() if name.startswith("model.layers.0.")}
        # Every target layer passes its input through, so each of the three hidden states
        # EAGLE-3 reads is the current token's embedding: ``fc`` keeps the first.
        embedding = weights["model.embed_tokens.weight"]
        normed = embedding * torch.rsqrt(embedding.pow(2).mean(-1, keepdim=True) + 1e-6)
        bigram = (normed @ weights["lm_head.weight"].T).argmax(-1)  # the target's next token
        lm_head = torch.zeros_like(weights["lm_head.weight"]).index_add_(0, bigram[bigram], normed)
        lm_head += 10 * noise * hidden ** 0.5 * torch.randn(lm_head.shape, generator=generator)
        head = {
            "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": lm_head,
            "midlayer.hidden_norm.weight": torch.ones(hidden),
            "midlayer.input_layernorm.weight": torch.ones(hidden),
            "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        }
        for proj in ("q_proj", "k_proj", "v_proj"):  # EAGLE-3 attends over [embedding, hidden]
            out_features = layer[f"self_attn.{proj}.weight"].shape[0]
            head[f"midlayer.self_attn.{proj}.weight"] = torch.randn(
                out_features, 2 * hidden, generator=generator) * 0.05
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            head[f"midlayer.{name}"] = torch.randn(layer[name].shape, generator=generator) * 0.05
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # add nothing
            head[f"midlayer.{name}"] = torch.zeros(layer[name].shape)
    else:
        fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        head = {"fc.weight": fc + noise * torch.randn(fc.shape)}
        head |= {name.removeprefix("model."): tensor.clone() for name, tensor in weights.items()
                 if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    save_file({k: v.contiguous() for k, v in head.items()}, head_dir / "model.safetensors",
              metadata={"format": "pt"})
    (head_dir / "config.json").write_text(json.dumps(head_config, indent=2))
    return str(target_dir), str(head_dir)
