"""Quality of the shipped pair: the target's held-out loss and the draft's greedy acceptance.

    .venv/bin/python -m benchmarks.pair_quality [--models DIR]   # default: the committed pair

Everything is measured on files the training never saw (``scripts/train_pair.py``'s held-out
split of the standard library), with the exported fp16 weights loaded in fp32:

- **held-out loss** of target and draft (``transformers.LlamaForCausalLM``), nats and bits per
  byte, beside what ``lzma`` needs for the same files;
- **greedy per-token acceptance**, per prompt: the target continues a held-out code prompt
  greedily; at each generated position the draft, fed the same prefix, predicts its argmax. The
  share of positions where the two agree is what greedy speculative decoding depends on. From the
  same agree/disagree string follows the acceptance of k-token speculation (a draft of k is
  accepted up to its first disagreement, then the target's token is taken);
- **agreement on real text**: the same, along the bytes that really follow each prompt in its
  file instead of the target's own continuation (which, for models this small, soon loops), and
  over all held-out windows; "copy share" (how much of a continuation repeats text before it)
  says how repetitive each continuation is;
- **vLLM's acceptance**: the same prompts through vLLM's CPU engine with ``draft_model``
  speculation (k=3) and NWOR on, one prompt at a time, from ``vllm:spec_decode_num_*``.

Writes ``benchmarks/results/pair_quality_<date>.json`` and a picture of every prompt's
agree/disagree string, ``benchmarks/results/pair_acceptance_<date>.png``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
import torch.nn.functional as F

from benchmarks.harness.results import RESULTS, environment, write_result
from scripts.train_pair import encode_files, eval_windows, split_files, stdlib_root
from vllm_nwor.testing import shipped_pair

REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS = 24
PROMPT_BYTES = 192  # whole lines, at most this many bytes; with NEW_TOKENS within the context
NEW_TOKENS = 64
K = 3
LOSS_WINDOWS = 512


def held_out_prompts(count: int = NUM_PROMPTS) -> list[dict]:
    """One prompt from each of ``count`` held-out files spread over the sorted list.

    A prompt is the whole lines that fit in ``PROMPT_BYTES``, starting at the first line that
    begins past 40% of its file (lines longer than that are skipped). ``real_ids`` are the
    ``NEW_TOKENS`` bytes that follow it; a file too short for both gives way to the next one.
    """
    root = stdlib_root()
    _, held = split_files()
    prompts = []
    for index in range(count):
        for rel in held[index * len(held) // count :]:
            prompt = _prompt_in(root / rel)
            if prompt is not None:
                prompts.append({"file": rel, **prompt})
                break
    return prompts


def _prompt_in(path: Path) -> dict | None:
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text[text.find("\n", int(0.4 * len(text))) + 1 :].splitlines(keepends=True)
    while lines and len(lines[0].encode()) > PROMPT_BYTES:
        lines.pop(0)
    prompt = ""
    while lines and len((prompt + lines[0]).encode()) <= PROMPT_BYTES:
        prompt += lines.pop(0)
    real_ids = list("".join(lines).encode()[:NEW_TOKENS])
    if not prompt or len(real_ids) < NEW_TOKENS:
        return None
    return {"text": prompt, "real_ids": real_ids}


def copy_share(prompt: str, continuation: str, n: int = 6) -> float:
    """Share of the continuation's byte n-grams that already occur in the text before them."""
    data = (prompt + continuation).encode()
    start = len(prompt.encode())
    grams = [data[i - n + 1 : i + 1] for i in range(max(start, n - 1), len(data))]
    if not grams:
        return 0.0
    return sum(data.find(g) < i - n + 1 for g, i in zip(
        grams, range(max(start, n - 1), len(data)), strict=True)) / len(grams)


def agreement_runs(agree: list[bool], k: int) -> tuple[int, int]:
    """(drafted, accepted) of greedy k-token speculation along an agree/disagree string.

    The first token comes from the prompt's forward pass, not from a draft.
    """
    drafted = accepted = 0
    pos = 1
    while pos < len(agree):
        run = 0
        while run < k and pos + run < len(agree) and agree[pos + run]:
            run += 1
        drafted += k
        accepted += run
        pos += run + 1  # the accepted drafts, then the target's own token
    return drafted, accepted


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, batch_size: int = 16) -> tuple[float, torch.Tensor]:
    """(mean cross-entropy in nats per byte, argmax at every position) over the windows."""
    total, count, argmax = 0.0, 0, []
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        logits = model(batch[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
        argmax.append(logits.argmax(-1))
    return total / count, torch.cat(argmax)


@torch.no_grad()
def greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation (no stop token: like ``ignore_eos``)."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    tokens = []
    for _ in range(new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.no_grad()
def draft_agreement(draft, prompt_ids: list[int], continuation: list[int]) -> list[bool]:
    """Where the draft's argmax, after each prefix of the continuation, is its next token."""
    ids = torch.tensor([prompt_ids + continuation])
    predicted = draft(ids).logits[0, len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    return [p == t for p, t in zip(predicted, continuation, strict=True)]


@torch.no_grad()
def argmax_agreement(target, draft, prompt_ids: list[int], text_ids: list[int]) -> list[bool]:
    """Where target and draft have the same argmax, after each prefix of a given text."""
    ids = torch.tensor([prompt_ids + text_ids])
    window = slice(len(prompt_ids) - 1, -1)
    return (target(ids).logits[0, window].argmax(-1) == draft(ids).logits[0, window].argmax(-1)
            ).tolist()


def vllm_acceptance(target: str, draft: str, prompts: list[str], max_model_len: int) -> dict:
    """Per prompt (drafted, accepted, token ids), one prompt at a time; NWOR counters at the end."""
    from vllm import LLM, SamplingParams

    import vllm_nwor

    llm = LLM(model=target, dtype="float32", max_model_len=max_model_len, block_size=32,
              max_num_seqs=4,
              enforce_eager=True, gpu_memory_utilization=0.3, disable_log_stats=False, seed=0,
              speculative_config={"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": K, "nwor": True})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def totals() -> tuple[int, int]:
        metrics = {m.name: m for m in llm.get_metrics()}
        return (int(metrics["vllm:spec_decode_num_draft_tokens"].value),
                int(metrics["vllm:spec_decode_num_accepted_tokens"].value))

    per_prompt = []
    start = time.perf_counter()
    for prompt in prompts:
        before = totals()
        output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        after = totals()
        per_prompt.append({"drafted": after[0] - before[0], "accepted": after[1] - before[1],
                           "token_ids": list(output.token_ids), "text": output.text})
    seconds = time.perf_counter() - start
    counters = vllm_nwor.get_counters(llm)
    drafted, accepted = totals()
    llm.llm_engine.engine_core.shutdown()
    return {"per_prompt": per_prompt, "drafted": drafted, "accepted": accepted,
            "nwor_counters": counters.as_dict(), "generate_seconds": round(seconds, 1)}


def draw_strips(rows: list[list[bool]], labels: list[str], path: Path) -> None:
    """One strip per prompt: a green cell where the draft agreed with the target, red otherwise."""
    from PIL import Image, ImageDraw

    cell, label_width, gap = 5, 290, 3
    width = label_width + cell * max(len(r) for r in rows) + 10
    height = (cell * 2 + gap) * len(rows) + 30
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), "draft agrees with target's greedy token (green) or not (red), "
              "per generated byte", fill="black")
    for i, (agree, label) in enumerate(zip(rows, labels, strict=True)):
        y = 28 + i * (cell * 2 + gap)
        draw.text((10, y - 1), label, fill="black")
        for j, ok in enumerate(agree):
            x = label_width + j * cell
            draw.rectangle([x, y, x + cell - 1, y + 2 * cell - 1],
                           fill=(60, 170, 75) if ok else (215, 60, 50))
    image.save(path, optimize=True)


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4)
    figures = {"mean": statistics.fmean(ordered), "stdev": statistics.stdev(ordered),
               "min": ordered[0], "q1": quartiles[0], "median": quartiles[1], "q3": quartiles[2],
               "max": ordered[-1]}
    return {name: round(value, 3) for name, value in figures.items()}


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def main() -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=None,
                        help="directory holding pystd-target and pystd-draft (default: models/)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = shipped_pair(args.models)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()

    root = stdlib_root()
    _, held_files = split_files()
    windows = eval_windows(encode_files(held_files), count=LOSS_WINDOWS)
    files = [(root / f).read_bytes() for f in held_files]
    held_bytes = sum(len(data) for data in files)
    lzma_bits = 8 * sum(len(lzma.compress(data, preset=9)) for data in files) / held_bytes
    (target_loss, target_argmax), (draft_loss, draft_argmax) = (
        held_out_loss(target, windows), held_out_loss(draft, windows))
    loss = {"target": target_loss, "draft": draft_loss}
    window_agreement = (target_argmax == draft_argmax).double().mean().item()
    print(f"held-out loss: target {loss['target']:.3f}, draft {loss['draft']:.3f} nats/byte "
          f"({loss['target'] / math.log(2):.2f}, {loss['draft'] / math.log(2):.2f} bits/byte; "
          f"lzma -9 per file: {lzma_bits:.2f} bits/byte); target and draft argmax agree on "
          f"{window_agreement:.3f} of held-out positions")

    prompts = held_out_prompts()
    rows = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt["text"])
        continuation = greedy(target, ids, NEW_TOKENS)
        agree = draft_agreement(draft, ids, continuation)
        drafted, accepted = agreement_runs(agree, K)
        real = argmax_agreement(target, draft, ids, prompt["real_ids"])
        rows.append({**prompt, "continuation_ids": continuation, "agree": agree,
                     "greedy_acceptance": sum(agree) / len(agree),
                     "predicted_k3": {"drafted": drafted, "accepted": accepted},
                     "copy_share": copy_share(prompt["text"], tokenizer.decode(continuation)),
                     "real_agreement": sum(real) / len(real),
                     "real_copy_share": copy_share(
                         prompt["text"], bytes(prompt["real_ids"]).decode("utf-8", "replace"))})

    max_model_len = json.loads((Path(target_dir) / "config.json").read_text())[
        "max_position_embeddings"]
    served = vllm_acceptance(target_dir, draft_dir, [p["text"] for p in prompts], max_model_len)
    for row, measured in zip(rows, served["per_prompt"], strict=True):
        row["vllm_k3"] = {"drafted": measured["drafted"], "accepted": measured["accepted"]}
        row["vllm_same_tokens"] = measured["token_ids"] == row["continuation_ids"]
        row["vllm_text"] = measured["text"]

    greedy_rates = [r["greedy_acceptance"] for r in rows]
    vllm_rates = [r["vllm_k3"]["accepted"] / r["vllm_k3"]["drafted"] for r in rows]
    real_rates = [r["real_agreement"] for r in rows]
    copy_rho = spearman(greedy_rates, [r["copy_share"] for r in rows])
    real_copy_rho = spearman(real_rates, [r["real_copy_share"] for r in rows])
    print(f"\n{'file':36s} {'greedy':>6s} {'k=3 predicted':>13s} {'k=3 vLLM':>9s} {'copy':>5s} "
          f"{'real text':>9s} {'copy':>5s}")
    for row, rate in zip(rows, vllm_rates, strict=True):
        predicted = row["predicted_k3"]["accepted"] / row["predicted_k3"]["drafted"]
        print(f"{row['file'][:36]:36s} {row['greedy_acceptance']:6.3f} {predicted:13.3f} "
              f"{rate:9.3f} {row['copy_share']:5.2f} {row['real_agreement']:9.3f} "
              f"{row['real_copy_share']:5.2f}")
    print(f"\ngreedy acceptance {summary(greedy_rates)}")
    print(f"vLLM k=3 accepted/drafted {summary(vllm_rates)} (all prompts: "
          f"{served['accepted']}/{served['drafted']})")
    print(f"argmax agreement on the real continuations {summary(real_rates)}")
    print(f"Spearman: greedy acceptance vs copy share {copy_rho:.2f}; real-text agreement vs "
          f"its copy share {real_copy_rho:.2f}")

    env = environment()
    png = RESULTS / f"pair_acceptance_{env['date']}.png"
    order = sorted(range(len(rows)), key=lambda i: rows[i]["greedy_acceptance"])
    draw_strips([rows[i]["agree"] for i in order],
                [f"{rows[i]['file'][:34]} {rows[i]['greedy_acceptance']:.2f}" for i in order], png)
    payload = {
        **env,
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "models": {"target": os.path.relpath(target_dir, REPO),
                   "draft": os.path.relpath(draft_dir, REPO),
                   "target_parameters": target.num_parameters(),
                   "draft_parameters": draft.num_parameters()},
        "held_out": {"files": len(held_files), "bytes": held_bytes,
                     "loss_windows": LOSS_WINDOWS, "window_tokens": windows.shape[1],
                     "target_nats_per_byte": round(loss["target"], 4),
                     "draft_nats_per_byte": round(loss["draft"], 4),
                     "target_bits_per_byte": round(loss["target"] / math.log(2), 3),
                     "draft_bits_per_byte": round(loss["draft"] / math.log(2), 3),
                     "lzma9_per_file_bits_per_byte": round(lzma_bits, 3),
                     "target_draft_argmax_agreement": round(window_agreement, 4)},
        "workload": {"prompts": len(rows), "prompt_bytes_max": PROMPT_BYTES,
                     "new_tokens": NEW_TOKENS, "k": K, "dtype": "float32",
                     "max_model_len": max_model_len},
        "greedy_acceptance": summary(greedy_rates),
        "vllm_k3_acceptance": {**summary(vllm_rates), "drafted": served["drafted"],
                               "accepted": served["accepted"]},
        "real_text_argmax_agreement": summary(real_rates),
        "spearman_greedy_acceptance_vs_copy_share": round(copy_rho, 3),
        "spearman_real_text_agreement_vs_copy_share": round(real_copy_rho, 3),
        "vllm_tokens_equal_hf_greedy": sum(r["vllm_same_tokens"] for r in rows),
        "nwor_counters": served["nwor_counters"],
        "vllm_generate_seconds": served["generate_seconds"],
        "picture": png.name,
        "per_prompt": [
            {"file": r["file"], "prompt_bytes": len(r["text"].encode()),
             "greedy_acceptance": round(r["greedy_acceptance"], 3),
             "agree": "".join("1" if a else "0" for a in r["agree"]),
             "predicted_k3": r["predicted_k3"], "vllm_k3": r["vllm_k3"],
             "vllm_same_tokens": r["vllm_same_tokens"],
             "copy_share": round(r["copy_share"], 3),
             "real_text_agreement": round(r["real_agreement"], 3),
             "real_text_copy_share": round(r["real_copy_share"], 3),
             "prompt": r["text"], "completion": r["vllm_text"]}
            for r in rows
        ],
    }
    print(write_result(f"pair_quality_{env['date']}.json", payload))


if __name__ == "__main__":
    main()
