"""Trains the shipped target/draft pair: byte-level Llamas on the Python standard library's source.

    python scripts/train_pair.py                  # CPU, 2 threads, about 10 minutes
    python scripts/train_pair.py --device cuda    # the same recipe on a GPU (different numerics)

It writes ``models/pystd-target`` and ``models/pystd-draft`` (Hugging Face Llama checkpoints:
config.json, generation_config.json, model.safetensors in fp16, tokenizer.json,
tokenizer_config.json) and a record of the run, ``benchmarks/results/train_pair_<date>.json``.

Data: every ``.py`` file of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), except ``site-packages`` and test directories, in sorted
order. A file is held out when the SHA-256 of its relative path is 0 mod 10 (about a tenth of
the files); the split does not depend on file contents or on the machine. Each file becomes
``<s>`` + its bytes + ``</s>``; the training stream is the training files back to back.

Tokens are bytes: ids 0-255 are the byte values, then ``<s>`` (256), ``</s>`` (257) and ``<pad>``
(258). The tokenizer is a byte-level BPE with no merges, so ``decode(encode(s)) == s`` for any
string. It adds no ``<s>``, and ``split_special_tokens`` makes text such as ``"</s>"`` plain bytes.

The model is written in a few lines of PyTorch with Hugging Face Llama's parameter names and
arithmetic (RMSNorm, rotary embeddings with ``rotate_half``, grouped-query attention, SwiGLU), so
the state dict exports as it is. ``tests/unit/test_train_pair.py`` checks the export against
``transformers.LlamaForCausalLM``; ``tests/engine/test_model_pair.py`` runs the pair in vLLM.

Reproducible: seeded (torch, numpy), deterministic algorithms, a fixed number of steps, a fixed
thread count. Re-running with the same Python standard library, torch build, thread count and
CPU writes the same bytes. Another Python version has another standard library, so it trains
another (similar) pair; the committed one was trained on CPython 3.11.7's (see
docs/model_pair.md for the recipe, its timings and why the models have these sizes).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"
RESULTS = REPO / "benchmarks" / "results"

BOS, EOS, PAD = 256, 257, 258
SPECIAL_TOKENS = {"<s>": BOS, "</s>": EOS, "<pad>": PAD}
VOCAB_SIZE = 259
CONTEXT = 256  # training sequence length = max_position_embeddings
HELD_OUT_MODULUS = 10
SKIP_DIRS = {"site-packages", "test", "tests"}


@dataclass(frozen=True)
class ModelSpec:
    """One model of the pair and its training budget."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    steps: int
    batch_size: int
    lr: float
    warmup: int = 50

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


TARGET = ModelSpec("pystd-target", hidden_size=192, num_layers=5, num_heads=6, num_kv_heads=2,
                   intermediate_size=512, steps=2200, batch_size=8, lr=3e-3)
DRAFT = ModelSpec("pystd-draft", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=344, steps=400, batch_size=8, lr=3e-3)


# ---------------------------------------------------------------------------------------------
# Data


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths (POSIX) of the standard library's .py files, sorted."""
    root = root or stdlib_root()
    files = [
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if path.is_file() and not SKIP_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: is this Python's standard library?")
    return sorted(files)


def is_held_out(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_MODULUS == 0


def split_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(training files, held-out files), both sorted."""
    files = stdlib_files(root)
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def encode_files(relative_paths: list[str], root: Path | None = None) -> np.ndarray:
    """The files as one token stream: <s> bytes </s>, back to back (uint16)."""
    root = root or stdlib_root()
    parts = []
    for rel in relative_paths:
        data = np.frombuffer((root / rel).read_bytes(), dtype=np.uint8).astype(np.uint16)
        parts.append(np.concatenate([[BOS], data, [EOS]]).astype(np.uint16))
    return np.concatenate(parts)


def eval_windows(stream: np.ndarray, count: int, length: int = CONTEXT + 1) -> torch.Tensor:
    """``count`` evenly spaced windows of ``length`` tokens (a fixed held-out sample)."""
    starts = np.linspace(0, len(stream) - length, count).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]).astype(np.int64))


# ---------------------------------------------------------------------------------------------
# Model: Hugging Face Llama's arithmetic and parameter names


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, h, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        repeat = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, eps) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, eps)


class Llama(nn.Module):
    """``LlamaForCausalLM`` for training: same parameter names, no cache, no padding."""

    rms_norm_eps = 1e-5
    rope_theta = 10000.0

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, self.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, VOCAB_SIZE, bias=False)
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
        )
        freqs = torch.outer(torch.arange(CONTEXT).float(), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Training


@torch.no_grad()
def held_out_loss(model: Llama, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean cross-entropy (nats per token) over every position of the windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(next(model.parameters()).device)
        logits = model(batch[:, :-1])
        total += F.cross_entropy(
            logits.reshape(-1, VOCAB_SIZE).float(), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def learning_rate(spec: ModelSpec, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(spec: ModelSpec, stream: np.ndarray, held_out: torch.Tensor, device: torch.device,
          seed: int, log_every: int = 100) -> tuple[Llama, dict]:
    torch.manual_seed(seed)
    model = Llama(spec).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    rng = np.random.default_rng(seed)
    offsets = np.arange(CONTEXT + 1)
    curve = []
    start = time.perf_counter()
    for step in range(spec.steps):
        starts = rng.integers(0, len(stream) - CONTEXT - 1, size=spec.batch_size)
        batch = torch.from_numpy(stream[starts[:, None] + offsets].astype(np.int64)).to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(spec, step)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == spec.steps - 1:
            elapsed = time.perf_counter() - start
            curve.append({"step": step, "train_loss": round(loss.item(), 4),
                          "seconds": round(elapsed, 1)})
            print(f"{spec.name} step {step:4d}/{spec.steps} loss {loss.item():.3f} "
                  f"({elapsed:.0f}s)", flush=True)
    seconds = time.perf_counter() - start
    loss = held_out_loss(model, held_out)
    print(f"{spec.name}: held-out {loss:.4f} nats/byte = {loss / math.log(2):.3f} bits/byte, "
          f"{seconds:.0f}s", flush=True)
    record = {
        "spec": asdict(spec),
        "parameters": num_parameters(model),
        "train_tokens": spec.steps * spec.batch_size * CONTEXT,
        "train_seconds": round(seconds, 1),
        "held_out_nats_per_byte_fp32": round(loss, 4),
        "curve": curve,
    }
    return model, record


# ---------------------------------------------------------------------------------------------
# Export: a Hugging Face Llama checkpoint with a byte-level tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizer_json() -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    symbols = bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for content, token_id in SPECIAL_TOKENS.items()
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbols[b]: b for b in range(256)},
            "merges": [],
        },
    }


# Chat requests to ``vllm serve``: the messages' contents, one per line, continued as code.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}"
                 "{% if not loop.last %}\n{% endif %}{% endfor %}")


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": CONTEXT,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(spec: ModelSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": Llama.rms_norm_eps,
        "rope_theta": Llama.rope_theta,
        "rope_parameters": {"rope_theta": Llama.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "torch_dtype": "float16",
        "use_cache": True,
    }


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export(model: Llama, out_dir: Path) -> None:
    """Writes the checkpoint (fp16 weights) and the tokenizer into ``out_dir``."""
    from safetensors.torch import save_file

    state = {name: t.detach().to("cpu", torch.float16).contiguous()
             for name, t in model.state_dict().items()}
    for name, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} does not fit in fp16 (max |w| "
                             f"{model.state_dict()[name].abs().max().item():.3g})")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    write_json(out_dir / "config.json", model_config(model.spec))
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD})
    write_json(out_dir / "tokenizer.json", tokenizer_json())
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())


# ---------------------------------------------------------------------------------------------


def git_commit() -> str:
    """HEAD of the checkout this script runs from, with -dirty if tracked files changed."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO,
                              check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!models")
        return git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=MODELS, help="where the two models go")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="scale both models' step counts (e.g. 0.05 for a smoke run)")
    parser.add_argument("--no-record", action="store_true",
                        help="don't write benchmarks/results/train_pair_<date>.json")
    args = parser.parse_args()

    wall_start = time.perf_counter()
    commit = git_commit()  # before the models are rewritten
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")

    train_files, held_files = split_files()
    train_stream = encode_files(train_files)
    held_stream = encode_files(held_files)
    held_out = eval_windows(held_stream, count=64)
    print(f"stdlib {stdlib_root()}: {len(train_files)} training files ({len(train_stream)} "
          f"tokens), {len(held_files)} held out ({len(held_stream)} tokens)", flush=True)

    records = {}
    for index, spec in enumerate((TARGET, DRAFT)):
        if args.steps_scale != 1.0:
            steps = max(1, round(spec.steps * args.steps_scale))
            spec = ModelSpec(**{**asdict(spec), "steps": steps, "warmup": min(spec.warmup, steps)})
        model, records[spec.name] = train(spec, train_stream, held_out, device,
                                          seed=args.seed + index)
        export(model, args.out / spec.name)
        weights = (args.out / spec.name / "model.safetensors").read_bytes()
        records[spec.name]["safetensors_sha256"] = hashlib.sha256(weights).hexdigest()
        records[spec.name]["safetensors_bytes"] = len(weights)
    wall = time.perf_counter() - wall_start
    print(f"wrote {args.out / TARGET.name} and {args.out / DRAFT.name} in {wall:.0f}s")

    if not args.no_record:
        record = {
            "date": datetime.date.today().isoformat(),
            "commit": commit,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda"
            else f"{platform.processor() or platform.machine()}, {args.threads} threads",
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python", *sys.argv]),
            "data": {"stdlib": str(stdlib_root()), "train_files": len(train_files),
                     "held_out_files": len(held_files), "train_tokens": int(len(train_stream)),
                     "held_out_tokens": int(len(held_stream))},
            "wall_seconds": round(wall, 1),
            "models": records,
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"train_pair_{record['date']}.json"
        write_json(path, record)
        print(path)


if __name__ == "__main__":
    main()
