"""Seconds and peak memory of the data stages on N MB of extra plain text, as a user would run them.

    python -m benchmarks.scale.data_scale [--sizes 20,100,1000] [--workers 1,2] [--engine local|dask]
                                          [--project DIR] [--keep] [--code DIR] [--seed 0]

What a user does: add one plain-text source of N MB (`data/sources/bench.txt`, N x 10^6 bytes of
varied documents) to `ingest.sources` of the shipped sample pipeline, then run the stages. Here:

1. The project: `git clone` of this repository into a fresh directory (`--project`, default a
   temporary one), with `pipelines/`, `dvc.yaml`, `params.yaml` and `params/` copied over from the
   working tree of `--code` (default: this repository's, uncommitted changes included), so what is
   measured is the code as it is now. The clone's own `mlflow.db` is the tracking store.
2. `sample_data` and `base_model` once, untimed; then per size, engine and worker count, each of
   `ingest`, `prepare_data`, `train_tokenizer`, `tokenize` in order as its own process
   (`python -m pipelines.<stage>` in the project, exactly what `dvc repro` runs), with
   `QLLM_DATA_WORKERS=<w>` and `QLLM_DATA_ENGINE=<engine>` (stages that ignore them run as before).
   `--engine dask` runs every worker count under both engines: local processes and a local Dask
   cluster. TOKENIZERS_PARALLELISM, MLFLOW_TRACKING_URI, DVC_STAGE and the Dask scheduler address
   are removed from the stages' environment (a plain shell's defaults).
3. Per stage: wall seconds of the process (interpreter start and imports included) and the stage's
   own `seconds` (its metrics file), MB/s of input (N / wall seconds), the peak summed RSS of the
   process and all its descendants (worker processes, a Dask cluster; sampled every 0.05 s with
   psutil: pages shared between processes count once per process) and the main process's
   `peak_rss_mb` from `data/metrics/<stage>.json`. Memory is in MB of 2^20 bytes (as the metrics
   files), input in MB of 10^6 bytes. The tree's peak is sampled, so it can miss a spike shorter
   than the interval that the main process's exact high-water mark (`peak_rss_mb`) catches. `cpu s`:
   user + system CPU seconds of the tree (less sensitive than wall time to other load on the
   machine). Then the ingest + prepare_data throughput, the speed-up of every worker count over the
   first (wall time ratio, measured in this command) and, with `--engine dask`, of the Dask cluster
   over local processes; and whether every run of a size wrote the same bytes (data/ingested,
   prepared, tokenizer, tokenized).

The generated text: documents of 3-40 sentences drawn (seeded numpy Generator) from the Python
documentation that ships with Python (`pydoc_data.topics`, so the same seed gives the same bytes on
the same Python version), one document per run of lines, documents separated by a blank line, about
1% exact duplicates and 1% near duplicates (a copy with its last word changed) of earlier documents,
cut to exactly N x 10^6 bytes at a document boundary (the last document is shortened to fit). Its
vocabulary is that of the docs (~10^4 words) whatever N: the tokenizer trainer's merge phase does
not grow with N as it would on real data.

The project directory is deleted at the end unless `--keep`. A stage that fails prints the tail of
its output and the benchmark exits with 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from benchmarks import common

STAGES = ("ingest", "prepare_data", "train_tokenizer", "tokenize")
SETUP_STAGES = ("sample_data", "base_model")  # run once, untimed (train_tokenizer reads data/base_model.json)
OUTPUTS = ("data/ingested", "data/prepared", "data/tokenizer", "data/tokenized")
SOURCE = "data/sources/bench.txt"
NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
DROPPED_ENV = ("TOKENIZERS_PARALLELISM", "MLFLOW_TRACKING_URI", "DVC_STAGE", "QLLM_DASK_ADDRESS", "DASK_SCHEDULER_ADDRESS")
MiB = 2**20


# ------------------------------------------------------------------------------ the text


@functools.cache
def sentences() -> tuple[bytes, ...]:
    """Sentences (and short paragraphs) of the Python docs, whitespace collapsed, 20-400 bytes, unique."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    pieces = (" ".join(piece.split()).encode() for piece in re.split(r"(?<=[.!?:;])\s+|\n\s*\n", text))
    return tuple(dict.fromkeys(piece for piece in pieces if 20 <= len(piece) <= 400))


@functools.cache
def words() -> tuple[bytes, ...]:
    """Plain words of 3+ letters of those sentences: what a near duplicate's last word becomes."""
    found = (w for s in sentences() for w in re.findall(rb"[A-Za-z]{3,}", s))
    return tuple(sorted(set(found)))


@dataclass
class Generated:
    bytes: int = 0
    documents: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0


def generate(path: Path | str, n_bytes: int, seed: int = 0, duplicates: float = 0.01, near_duplicates: float = 0.01,
             batch: int = 4096) -> Generated:  # fmt: skip
    """Write exactly `n_bytes` of documents to `path` (see the module docstring); deterministic by `seed`.

    Every document is a recipe (batch, start, count, last word): `count` sentence indices from
    `start` in that batch's index array, and the index of the word that replaces its last one (-1:
    none). A duplicate copies the recipe of a uniformly drawn earlier document, a near duplicate
    too but with another last word, so duplicates lie anywhere before their original, not only
    close to it, and nothing but the recipes is kept in memory.
    """
    sents, vocab = sentences(), words()
    rng = np.random.default_rng(seed)
    batches: list[np.ndarray] = []
    recipes: list[tuple[int, int, int, int]] = []
    stats = Generated()

    def base_text(recipe: tuple[int, int, int, int], current: list[int] | None) -> bytes:
        b, start, count, _ = recipe
        indices = current[start : start + count] if current is not None and b == len(batches) - 1 else batches[b][start : start + count].tolist()
        return b" ".join([sents[i] for i in indices])

    with open(path, "wb") as out:
        while True:
            counts = rng.integers(3, 41, batch)
            indices = rng.integers(0, len(sents), int(counts.sum()), dtype=np.int32)
            kind, pick, word = rng.random(batch), rng.random(batch), rng.integers(0, len(vocab), batch)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            batches.append(indices)
            current, counts_l = indices.tolist(), counts.tolist()
            chunk: list[bytes] = []
            chunk_bytes = 0
            for k in range(batch):
                n = len(recipes)
                if n and kind[k] < duplicates + near_duplicates:
                    recipe = recipes[int(pick[k] * n)]
                    text = base_text(recipe, current)
                    if kind[k] < duplicates:
                        stats.exact_duplicates += 1
                        if recipe[3] >= 0:
                            text = text[: text.rfind(b" ") + 1] + vocab[recipe[3]]
                    else:
                        stats.near_duplicates += 1
                        cut = text.rfind(b" ") + 1
                        w = int(word[k])
                        while vocab[w] == text[cut:] or w == recipe[3]:
                            w = (w + 1) % len(vocab)
                        recipe = (*recipe[:3], w)
                        text = text[:cut] + vocab[w]
                else:
                    recipe = (len(batches) - 1, starts[k], counts_l[k], -1)
                    text = base_text(recipe, current)
                left = n_bytes - stats.bytes - chunk_bytes
                if len(text) + 2 > left:  # the last document: shortened to fill the file exactly
                    if left >= 2:
                        cut = left - 1
                        while cut and text[cut] & 0xC0 == 0x80:  # not inside a UTF-8 sequence
                            cut -= 1
                        chunk.append(text[:cut] + b"." * (left - 1 - cut) + b"\n")
                        stats.documents += 1
                    elif left == 1:
                        chunk.append(b"\n")
                    out.write(b"".join(chunk))
                    stats.bytes = n_bytes
                    return stats
                recipes.append(recipe)
                chunk.append(text + b"\n\n")
                chunk_bytes += len(text) + 2
                stats.documents += 1
            out.write(b"".join(chunk))
            stats.bytes += chunk_bytes


# ----------------------------------------------------------------------- process memory


class TreePeak:
    """Peak summed RSS of process `pid` and all its descendants, sampled every `interval` s in a thread.

        proc = subprocess.Popen(...)
        with TreePeak(proc.pid) as peak:
            proc.wait()
        peak.peak_mb
    """

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._cpu: dict[tuple[int, float], float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="tree-rss", daemon=True)

    def tree_rss(self) -> int:
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in tree:
            with contextlib.suppress(psutil.Error), proc.oneshot():  # ended meanwhile, or a zombie
                total += proc.memory_info().rss
                times = proc.cpu_times()
                self._cpu[proc.pid, proc.create_time()] = times.user + times.system
        return total

    @property
    def cpu_seconds(self) -> float:
        """User + system CPU seconds of every process seen, as of its last sample."""
        return sum(self._cpu.values())

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.tree_rss())
            self.samples += 1
            if self._done.wait(self.interval):
                return

    @property
    def peak_mb(self) -> float:
        return self.peak / MiB

    def __enter__(self) -> TreePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


# ---------------------------------------------------------------------------- the project


class StageFailed(Exception):
    def __init__(self, stage: str, code: int, log: Path) -> None:
        super().__init__(f"{stage} exited with {code}")
        self.stage, self.code, self.log = stage, code, log


def copy_code(code: Path, project: Path) -> None:
    """pipelines/, dvc.yaml, params.yaml and params/ of `code`'s working tree over the clone's."""
    for name in ("pipelines", "params"):
        if (code / name).is_dir():
            shutil.rmtree(project / name, ignore_errors=True)
            shutil.copytree(code / name, project / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(code / name, project / name)


def add_text_source(params_path: Path, source: str) -> None:
    """Append `{path: source, kind: text}` to `ingest.sources`, keeping the file's comments; a layout
    the line edit does not recognise is rewritten by a YAML round trip (comments lost)."""
    import yaml

    lines = params_path.read_text().splitlines(keepends=True)
    entry = {"path": source, "kind": "text"}
    edited = None
    with contextlib.suppress(StopIteration):
        top = next(i for i, line in enumerate(lines) if re.match(r"ingest:\s*(#.*)?$", line))
        end = next((i for i in range(top + 1, len(lines)) if re.match(r"[^\s#]", lines[i])), len(lines))
        at = next(i for i in range(top + 1, end) if re.match(r"\s+sources:\s*(#.*)?$", lines[i]))
        indent = len(lines[at]) - len(lines[at].lstrip())
        last, item_indent = None, None
        for i in range(at + 1, end):
            stripped = lines[i].lstrip()
            if not stripped.strip() or stripped.startswith("#"):
                continue
            depth = len(lines[i]) - len(stripped)
            if depth <= indent:
                break
            if stripped.startswith("- ") and (item_indent is None or depth == item_indent):
                item_indent = depth
            last = i
        if last is not None and item_indent is not None:
            edited = [*lines[: last + 1], f"{' ' * item_indent}- {{path: {source}, kind: text}}\n", *lines[last + 1 :]]
    if edited is not None and (yaml.safe_load("".join(edited)).get("ingest") or {}).get("sources", [None])[-1] == entry:
        params_path.write_text("".join(edited))
        return
    data = yaml.safe_load("".join(lines))
    data.setdefault("ingest", {}).setdefault("sources", []).append(entry)
    params_path.write_text(yaml.safe_dump(data, sort_keys=False))


def make_project(project: Path, repo: Path, code: Path) -> None:
    if project.exists() and any(project.iterdir()):
        raise SystemExit(f"--project {project}: exists and is not empty")
    subprocess.run(["git", "clone", "-q", str(repo), str(project)], check=True)
    copy_code(code, project)
    add_text_source(project / "params.yaml", SOURCE)
    (project / SOURCE).parent.mkdir(parents=True, exist_ok=True)


def stage_env(project: Path, workers: int, engine: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(project), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["QLLM_DATA_WORKERS"] = str(workers)
    env["QLLM_DATA_ENGINE"] = engine
    return env


@dataclass
class StageResult:
    stage: str
    seconds: float
    tree_peak_mb: float
    cpu_seconds: float
    metrics: dict = field(default_factory=dict)

    @property
    def main_peak_mb(self) -> float:
        return float(self.metrics.get("peak_rss_mb", float("nan")))

    @property
    def stage_seconds(self) -> float:
        return float(self.metrics.get("seconds", float("nan")))


def run_stage(project: Path, stage: str, env: dict[str, str], log: Path, interval: float = 0.05) -> StageResult:
    """`python -m pipelines.<stage>` in `project`, timed, its process tree's RSS sampled; output to `log`."""
    metrics_file = project / "data" / "metrics" / f"{stage}.json"
    metrics_file.unlink(missing_ok=True)
    with open(log, "wb") as out:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", f"pipelines.{stage}"], cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT)
        with TreePeak(proc.pid, interval) as peak:
            _, status, usage = os.wait4(proc.pid, 0)  # usage: the process and the descendants it waited for
            proc.returncode = code = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
    if code != 0:
        raise StageFailed(stage, code, log)
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    cpu = max(usage.ru_utime + usage.ru_stime, peak.cpu_seconds)  # waited-for descendants exactly; others as sampled
    return StageResult(stage, seconds, peak.peak_mb, cpu, metrics)


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def outputs_digest(project: Path) -> dict[str, str]:
    """md5 over the relative paths and bytes of every file of each data stage output."""
    digests = {}
    for name in OUTPUTS:
        md5 = hashlib.md5()
        root = project / name
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            md5.update(file.relative_to(root).as_posix().encode() + b"\0")
            with open(file, "rb") as f:
                while block := f.read(1 << 22):
                    md5.update(block)
        digests[name] = md5.hexdigest()
    return digests


# ------------------------------------------------------------------------------ reporting


def machine() -> str:
    """The machine lines: the CPU (`common.cpu_name`), the cores this process may use, the memory,
    and which of `NOTABLE_FLAGS` the CPU has."""
    model, flags = common.cpu_name(), common.cpu_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    present = [f for f in NOTABLE_FLAGS if f in flags]
    absent = [f for f in NOTABLE_FLAGS if f not in flags]
    return (f"CPU: {model or 'unknown'}, {cores} cores available, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM\n"
            f"flags of note: {' '.join(present) or 'none'}" + (f" (absent: {' '.join(absent)})" if absent else ""))  # fmt: skip


def code_description(code: Path) -> str:
    def git(*args: str) -> str:
        result = subprocess.run(["git", "--no-optional-locks", "-C", str(code), *args], capture_output=True, text=True, check=False)
        return result.stdout.strip() if result.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--", "pipelines", "dvc.yaml", "params.yaml", "params").splitlines()
    return f"code: {code} (HEAD {head or '?'}, {len(changed)} changed or untracked paths under pipelines/, dvc.yaml, params.yaml, params/)"


def size_label(size: float) -> str:
    return f"{size:g} MB"


def print_run(size: float, engine: str, workers: int, results: list[StageResult]) -> None:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{size_label(size)}, engine {engine}, {workers} worker{'s' if workers != 1 else ''} (load average now {load})")
    print(f"  {'stage':<16}{'wall s':>9}{'stage s':>9}{'cpu s':>9}{'MB/s':>9}{'peak tree MB':>14}{'peak main MB':>14}")
    for r in results:
        print(f"  {r.stage:<16}{r.seconds:>9.2f}{r.stage_seconds:>9.2f}{r.cpu_seconds:>9.2f}{size / r.seconds:>9.2f}"
              f"{r.tree_peak_mb:>14.0f}{r.main_peak_mb:>14.0f}")  # fmt: skip
    both = results[0].seconds + results[1].seconds
    print(f"  ingest + prepare_data: {both:.2f} s, {size / both:.2f} MB/s; all four: {sum(r.seconds for r in results):.2f} s, "
          f"peak tree {max(r.tree_peak_mb for r in results):.0f} MB")  # fmt: skip


def print_ratio(title: str, slow: list[StageResult], fast: list[StageResult]) -> None:
    parts = [f"{a.stage} {a.seconds / b.seconds:.2f}x" for a, b in zip(slow, fast, strict=True)]
    both = (slow[0].seconds + slow[1].seconds) / (fast[0].seconds + fast[1].seconds)
    print(f"  {title}: {', '.join(parts)}; ingest+prepare_data {both:.2f}x")


def print_dedup(metrics: dict, generated: Generated) -> None:
    text = metrics.get("text", {})
    dropped = text.get("dropped", {})
    print(f"  prepare_data text: {text.get('in', '?')} in, dropped {dropped.get('duplicate', '?')} duplicate, "
          f"{dropped.get('near_duplicate', '?')} near_duplicate (generated: {generated.exact_duplicates} exact, "
          f"{generated.near_duplicates} near duplicates of {generated.documents} documents)")  # fmt: skip


def parse_list(raw: str, kind: type) -> list:
    return [kind(part) for part in raw.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,100,1000", help="MB (10^6 bytes) of extra text, comma-separated")
    parser.add_argument("--workers", default="1,2", help="QLLM_DATA_WORKERS values, comma-separated")
    parser.add_argument("--engine", default="local", choices=("local", "dask"), help="dask: local processes and a local Dask cluster")
    parser.add_argument("--project", type=Path, help="where to build the project (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the project directory")
    parser.add_argument("--code", type=Path, help="whose pipelines/, dvc.yaml, params.yaml, params/ (default: this repository's working tree)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between RSS samples")
    args = parser.parse_args(argv)

    repo = common.REPO
    code = (args.code or repo).resolve()
    sizes, worker_counts = parse_list(args.sizes, float), parse_list(args.workers, int)
    engines = ["local", "dask"] if args.engine == "dask" else ["local"]
    project = (args.project or Path(tempfile.mkdtemp(prefix="qllm-data-scale-"))).resolve()
    print(machine())
    print(code_description(code))
    print(f"project: {project}; Python {sys.version.split()[0]}; stages' environment without {', '.join(DROPPED_ENV)}")
    runs: dict[tuple[float, str, int], list[StageResult]] = {}
    try:
        make_project(project, repo, code)
        logs = project / ".bench-logs"
        logs.mkdir()
        for stage in SETUP_STAGES:
            run_stage(project, stage, stage_env(project, 1, "local"), logs / f"{stage}.log", args.interval)
        for size in sizes:
            started = time.perf_counter()
            generated = generate(project / SOURCE, round(size * 1e6), args.seed)
            print(f"\n== {size_label(size)}: {generated.documents} documents ({generated.exact_duplicates} exact, "
                  f"{generated.near_duplicates} near duplicates), generated in {time.perf_counter() - started:.1f} s")  # fmt: skip
            digests: dict[tuple[str, int], dict[str, str]] = {}
            for engine in engines:
                for workers in worker_counts:
                    env = stage_env(project, workers, engine)
                    results = [run_stage(project, stage, env, logs / f"{size:g}-{engine}-{workers}-{stage}.log", args.interval) for stage in STAGES]
                    runs[size, engine, workers] = results
                    print_run(size, engine, workers, results)
                    print_dedup(results[1].metrics, generated)
                    digests[engine, workers] = outputs_digest(project)
            first = next(iter(digests))
            for other, digest in digests.items():
                differ = [name for name in OUTPUTS if digest[name] != digests[first][name]]
                if other != first:
                    print(f"  outputs of {other[0]}/{other[1]} vs {first[0]}/{first[1]}: " + (f"DIFFER in {', '.join(differ)}" if differ else "same bytes"))
            for engine in engines:
                base = worker_counts[0]
                for workers in worker_counts[1:]:
                    print_ratio(f"speed-up {engine}, {workers} workers over {base} (wall time ratio)", runs[size, engine, base], runs[size, engine, workers])
            if len(engines) > 1:
                for workers in worker_counts:
                    print_ratio(f"dask over local, {workers} workers (wall time ratio)", runs[size, "local", workers], runs[size, "dask", workers])
    except StageFailed as exc:
        print(f"\nerror: stage {exc.stage} failed (exit {exc.code}); the end of its output ({exc.log.name}):\n{tail(exc.log)}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"\nproject kept: {project}")
        else:
            shutil.rmtree(project, ignore_errors=True)
    print("\nsummary (wall seconds; peak tree MB over the four stages)")
    print(f"  {'size':>8} {'engine':<7}{'workers':>8}" + "".join(f"{s:>17}" for s in STAGES) + f"{'ingest+prep MB/s':>18}{'peak MB':>9}")
    for (size, engine, workers), results in runs.items():
        both = results[0].seconds + results[1].seconds
        print(f"  {size_label(size):>8} {engine:<7}{workers:>8}" + "".join(f"{r.seconds:>17.2f}" for r in results)
              + f"{size / both:>18.2f}{max(r.tree_peak_mb for r in results):>9.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
