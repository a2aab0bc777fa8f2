"""What every benchmark result records (commit, versions, device) and how result files are
written: ``write_json``'s layout, a GPU run's jsonl records and their merge (``parse_or_merge``)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results"


def git_commit() -> str:
    """HEAD of this checkout; NWOR_COMMIT where the tree travelled without .git (GPU machine)."""
    if os.environ.get("NWOR_COMMIT"):
        return os.environ["NWOR_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    import torch
    import vllm

    import vllm_nwor

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    environment = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "vllm_nwor": vllm_nwor.__version__,
        "device": device or platform.machine(),
    }
    if torch.cuda.device_count() > 1:  # every GPU this process sees (tensor-parallel runs)
        environment["gpus"] = [torch.cuda.get_device_name(i)
                               for i in range(torch.cuda.device_count())]
    return environment


def recorded_environment(jsonl: Path) -> dict:
    """The environment a GPU run recorded beside its results (``environment.json``, written by
    ``scripts/gpu_suite.sh`` on the GPU machine): a merge on another machine must not describe
    itself."""
    path = jsonl.parent / "environment.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: merge the results where the GPU run wrote them "
                         "(scripts/gpu_suite.sh records the GPU's environment there)")
    return json.loads(path.read_text())


def parse_or_merge(parser, merge) -> object | None:
    """The GPU drivers' shared command line: ``--jsonl`` (where a run appends its records),
    or ``--merge JSONL --result JSON`` (here, afterwards: ``merge(jsonl, result)``). Returns the
    parsed arguments for a run, None when it merged."""
    parser.add_argument("--jsonl", type=Path, help="append this run's records here")
    parser.add_argument("--merge", type=Path, help="merge a run's records instead of running")
    parser.add_argument("--result", type=Path, help="with --merge: the JSON to write")
    args = parser.parse_args()
    if args.merge is None:
        return args
    if args.result is None:
        parser.error("--merge needs --result (the JSON file to write)")
    merge(args.merge, args.result)
    return None


def append_jsonl(path: Path | None, record: dict) -> None:
    """Appends one record (a GPU run's partial result survives a timed-out call)."""
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


RESULT_DEPTH = 4
"""How deep a result file's objects and lists of them are laid out, one item a line, before
the rest goes on one line without spaces."""


def result_json(value, level: int = 0) -> str:
    """A result file's text: the structure (cells, rows, groups, their fields) one item a line
    to :data:`RESULT_DEPTH`, the values below (step traces, lists of numbers) compact. Every
    device call carries the working tree (64 MiB with the devkit), and with every file indented
    ``benchmarks/results/`` had grown to 48 MB, which pushed the kit into eleven parts; laid out
    this way the same data takes 14 MB."""
    if level < RESULT_DEPTH and isinstance(value, dict) and value:
        items = [f"{' ' * (level + 1)}{json.dumps(str(key))}: {result_json(item, level + 1)}"
                 for key, item in value.items()]
    elif level < RESULT_DEPTH and isinstance(value, list) and any(
            isinstance(item, (dict, list)) for item in value):
        items = [" " * (level + 1) + result_json(item, level + 1) for item in value]
    else:
        return json.dumps(value, separators=(",", ":"))
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return opening + "\n" + ",\n".join(items) + "\n" + " " * level + closing


def write_json(path: Path, payload: dict) -> Path:
    """Writes a result file (:func:`result_json`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result_json(payload) + "\n")
    return path


def write_result(name: str, payload: dict) -> Path:
    return write_json(RESULTS / name, payload)
