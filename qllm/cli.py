"""The `qllm` command.

    qllm run                                   # run every stale stage of dvc.yaml
    qllm run --until pretrain                  # only up to (and including) pretrain
    qllm run --set pretrain.train.lr=0.001 --set evaluate.max_new_tokens=8
    qllm run --params params/tiny.yaml --summary-json summary.json

`qllm run` validates params and checks that the MLflow tracking store can be used (an
unreachable `MLFLOW_TRACKING_URI` server fails in seconds) before anything starts, runs the
Prefect flow `qllm-pipeline` locally (Prefect's ephemeral API; set PREFECT_API_URL to use a
server), and prints one line per stage: `NAME ran|cached SECONDS`. When every stage is up to date
it says so within a second or two and records nothing (no Prefect flow run, no MLflow run: nothing
ran; `--record` records one anyway, see `_check`). The exit code is non-zero when
a stage fails: 1, or 128 + the signal number (143 for SIGTERM, 130 for SIGINT) when a stop signal
ended the run (training checkpointed its last step: rerun the same command to resume).

After a run:

    qllm lineage models:/qllm@champion [--json]          # registered version -> stages -> raw data
    qllm generate --model models:/qllm@champion --prompt "Where does Tovik live?"
    qllm generate --model data/models/sft --prompt "What is 2 plus 3?" --temperature 0.8 --seed 1
    qllm generate --model data/models/multimodal --image digit.png --prompt "Which digit is this?"
    qllm compare --last 2 [--all] [--json]               # or: qllm compare RUN_ID RUN_ID ...
    qllm export --model models:/qllm@champion --out gguf/  # GGUF f16 + q8_0 and an Ollama Modelfile (docs/export.md)
    qllm serve-openai --model models:/qllm@champion      # OpenAI's chat completions API on 127.0.0.1:8000 (qllm/serving/openai_api.py)

Errors the user can act on (unknown model, alias, version or run id, no mlflow.db) exit with 2.

Every relative path on the command line (`--params`, `--summary-json`, `--model`, `--image`) is
relative to `--project-dir` (default: the current directory), never to where the command is typed:
`--project-dir DIR` runs as if started in DIR, like `git -C DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from pipelines.core import dag
from pipelines.core.errors import (
    QllmError,
    ask_stop,
    clear_stop,
    exit_without_collecting,
    request_stop,
    stop_requested,
    stop_signal,
)
from pipelines.core.params import files as params_file
from pipelines.core.paths import project_path
from pipelines.core.run import preflight


def _warm_up(root: Path, models: bool) -> None:
    """While the Prefect API boots in its own process: import DVC, open the MLflow store (cached),
    and, when a stage of the run loads models (`models`), import torch, transformers and PEFT
    (`repro.warm_imports`, about 5 s), which the first such stage would otherwise do on the
    pipeline's critical path."""
    import dvc.repo  # noqa: F401

    from pipelines.core.run import repro, tracking

    tracking.client(root)
    if models:
        repro.warm_imports()


def _print_summary(summary: dict) -> None:
    width = max(len(s["name"]) for s in summary["stages"])
    for stage in summary["stages"]:
        seconds = "-" if stage["seconds"] is None else f"{stage['seconds']:.2f}"
        print(f"{stage['name']:<{width}}  {stage['status']:<6}  {seconds}")
    if summary.get("model_version") is not None:
        print(f"registered model version {summary['model_version']}")
    if summary["mlflow_run_id"] is None:
        print(f"every stage is up to date: nothing ran, so no Prefect flow run or MLflow run was recorded (--record records one)"
              f"  ({summary['seconds']:.1f}s)")  # fmt: skip
    else:
        print(f"mlflow run {summary['mlflow_run_id']}  ({summary['seconds']:.1f}s)")


def _check(root: Path, params_data: dict, until: str | None) -> tuple[dict | None, str | None]:
    """(the summary of a run in which every stage is up to date, found without Prefect or MLflow
    (`repro.check`), else None; the first stale stage, else None).

    A no-change `qllm run` used to spend seconds starting a Prefect API and importing Prefect and
    MLflow only to record a flow run and a parent run in which every stage is `cached`: the
    outputs, their stage runs in MLflow and `dvc.lock` are those of the run that made them, so
    there is nothing new to record. `--record` (or `--force`, `--from-stage`) takes the full path;
    a Prefect deployment run always does (it calls the flow itself).
    """
    import time

    from pipelines.core import workspace
    from pipelines.core.run import repro

    started = time.perf_counter()
    ws = workspace.prepare(root, params_data)
    try:
        with workspace.locked(ws):
            outcomes, stale = repro.check(ws, dag.order(ws, until))
    finally:
        repro.close(ws)
    if stale is not None:
        return None, stale
    registered = ws / "data" / "register" / "registered.json"
    version = json.loads(registered.read_text())["version"] if any(o.name == "register" for o in outcomes) and registered.exists() else None
    return {"stages": [o.as_dict() for o in outcomes], "mlflow_run_id": None, "model_version": version, "workspace": str(ws),
            "seconds": round(time.perf_counter() - started, 3)}, None  # fmt: skip


def _loads_models(root: Path, args: argparse.Namespace, stale: str | None) -> bool:
    """Whether a stage that may run loads models (so the warm-up imports torch and transformers):
    the first stale stage or one after it, a forced stage, or `--from-stage` and what follows."""
    order = dag.order(root, args.until)
    starts = [name for name in (stale, args.from_stage, *args.force) if name is not None and name in order]
    if not starts:
        return False
    may_run = order[min(order.index(name) for name in starts):]
    return any(dag.MODELS_MODULE in dag.stages(root)[name].deps for name in may_run)


def _finish(summary: dict, args: argparse.Namespace) -> int:
    _print_summary(summary)
    if args.summary_json:
        project_path(args.summary_json, Path(args.project_dir).resolve()).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _sigterm(signum: int, frame=None) -> None:
    """The CLI's SIGTERM handler: a stop request, as for SIGINT (`request_stop`).

    While the flow runs, Prefect's engine owns SIGTERM: its handler raises `TerminationSignal` in
    the flow, which stops the stages (`flows.pipeline.stop_stages_on_termination`; a second SIGTERM
    there interrupts them at once). Once Prefect has torn the flow down, it passes the signal on to
    the handler it replaced, this one, and re-raises `TerminationSignal`: that stop is already
    honoured, so it is not counted as a second signal.
    """
    if stop_requested() is not None:
        return
    request_stop(signum, frame)


STOP_GRACE_ENV = "QLLM_STOP_GRACE_SECONDS"
"""Seconds the stages get to finish their step and checkpoint once the temporary Prefect API died (default 30)."""


def _api_lost(returncode: int, pid: int) -> None:
    """The temporary Prefect API died during the run (`LocalApi.watch`, in its watch thread).

    Nothing can be reported without it and Prefect's client would retry every call with back-off
    for minutes, so the run ends here: training stages stop after their current step with a
    checkpoint (as for a stop signal), every MLflow run still open is ended FAILED, and the process
    exits 1 with one error line.
    """
    import time

    from prefect.settings import PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW, temporary_settings

    from pipelines.core.run import tracking
    from pipelines.core.run.preflight import seconds

    with temporary_settings({PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW: "ignore"}):  # this thread has no flow run
        ask_stop("the Prefect API exited")
    grace = seconds(STOP_GRACE_ENV, 30.0)  # a training step and its checkpoint (other stages ignore the stop)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and tracking.open_runs(stages_only=True):
        time.sleep(0.1)
    if still := sorted(tracking.open_runs(stages_only=True).values()):
        print(f"warning: {', '.join(still)} still running {grace:g} s after the stop request; the newest checkpoint stays "
              f"(a step that takes longer needs a larger ${STOP_GRACE_ENV})", file=sys.stderr, flush=True)  # fmt: skip
    ended = tracking.end_open_runs("FAILED")
    print(f"error: the temporary Prefect API (pid {pid}) exited with code {returncode} during the run, so the run stopped: "
          "training stages saved a checkpoint after their current step (see the log above)"
          + (f"; MLflow runs ended FAILED: {', '.join(ended)}" if ended else "") + ". Rerun the same command to resume.",
          file=sys.stderr, flush=True)  # fmt: skip
    sys.stdout.flush()
    os._exit(1)  # Prefect's engine cannot finish without its API; its retries would hold the process for minutes


def cmd_run(args: argparse.Namespace) -> int:
    root = Path(args.project_dir).resolve()
    # Fail fast on bad params or an unknown stage: before Prefect, MLflow or any stage starts.
    _, params_data = params_file.load(root, args.params, args.set)
    stage_names = list(dag.stages(root))
    for name in [args.until, args.from_stage, *args.force]:
        if name is not None and name not in stage_names:
            raise QllmError(f"unknown stage {name!r}; stages are: {', '.join(stage_names)}")
    # An MLflow server that is down would otherwise fail the first stage only after Prefect started.
    preflight.check_tracking(root)
    stale = None
    if not (args.force or args.from_stage):
        summary, stale = _check(root, params_data, args.until)
        if summary is not None and not args.record:
            return _finish(summary, args)

    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "qllm")
    from prefect.exceptions import TerminationSignal
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from qllm.services.local_api import prefect_api

    # The Prefect API boots in its own process while this one imports the flow and warms up.
    models = _loads_models(root, args, stale)
    with prefect_api() as api:
        warmup = threading.Thread(target=_warm_up, args=(root, models), daemon=True)
        warmup.start()
        from flows.pipeline import pipeline

        settings = {}
        if api is not None:
            api.wait()
            api.watch(_api_lost)
            settings = {PREFECT_API_URL: api.url}
        warmup.join()
        # First SIGTERM/Ctrl-C: training stages checkpoint after their current step and stop, no new
        # stage starts; a second one interrupts at once (see _sigterm for how Prefect takes part).
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _sigterm), signal.SIGINT: signal.signal(signal.SIGINT, request_stop)}
        state = None
        try:
            with temporary_settings(updates=settings):
                state = pipeline(
                    overrides=args.set, params_files=args.params, until=args.until, force=args.force, project_dir=str(root),
                    from_stage=args.from_stage, return_state=True,
                )  # fmt: skip
        except TerminationSignal:  # Prefect ended the flow on SIGTERM, after its stages stopped
            state = None  # no flow state to read: reported below as a stop, with the exit code of the signal
        except KeyboardInterrupt:  # a second signal
            print("error: interrupted at once by a second signal; the newest checkpoints stay: rerun the same command "
                  "to resume from them", file=sys.stderr)  # fmt: skip
            return 130
        finally:
            if api is not None:
                api.unwatch()  # the flow is over: a server that dies now only shortens the log upload
            stopped, signum = stop_requested(), stop_signal()
            for s, handler in previous.items():
                signal.signal(s, handler)
            clear_stop()
    exit_code = 128 + signum if signum is not None else 1
    if state is None:
        print(f"error: stopped by {stopped or 'SIGTERM'}: training stages saved a checkpoint after their current step (see the log "
              "above); rerun the same command to resume", file=sys.stderr)  # fmt: skip
        return exit_code
    if not state.is_completed():
        try:
            state.result()
        except QllmError as exc:
            print(f"error: {exc}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - the traceback is already in the Prefect log above
            print(f"error: pipeline failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_code
    return _finish(state.result(), args)


def _quiet_downloads() -> None:
    """No per-artifact progress bars on the terminal (the commands print their own results)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def cmd_lineage(args: argparse.Namespace) -> int:
    _quiet_downloads()
    from qllm.registry import lineage

    trail = lineage.for_model(args.model_uri, Path(args.project_dir).resolve())
    print(json.dumps(trail, indent=2) if args.json else lineage.render(trail))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _quiet_downloads()
    from qllm.serving import generation

    root = Path(args.project_dir).resolve()
    if args.image is not None or generation.is_image_model(args.model, root):
        if args.image is not None and not generation.is_image_model(args.model, root):
            raise QllmError(f"{args.model}: a text-only model cannot look at --image; use the multimodal stage's model "
                            "(data/models/multimodal, or its registered version)")  # fmt: skip
        model, processor = generation.load_image_model(args.model, root)
        image = None if args.image is None else project_path(args.image, root)
        text = generation.generate_about_image(model, processor, image, args.prompt, max_new_tokens=args.max_new_tokens,
                                               temperature=args.temperature, seed=args.seed, system=args.system)  # fmt: skip
        print(text)
        return 0
    model, tokenizer = generation.load(args.model, root)
    text = generation.generate(
        model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, system=args.system
    )
    print(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _quiet_downloads()
    from pydantic import ValidationError

    from pipelines import export
    from pipelines.core.params.release import ExportParams
    from qllm.serving import generation

    root = Path(args.project_dir).resolve()
    types = args.type or ["f16", "q8_0"]
    try:
        params = ExportParams(enabled=True, types=types, modelfile=not args.no_modelfile, modelfile_type=args.modelfile_type or types[-1],
                              system=args.system)  # fmt: skip
    except ValidationError as exc:
        raise QllmError("; ".join(f"--type/--modelfile-type: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors())) from exc
    out = project_path(args.out, root)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / export.RECORD).exists())):
        raise QllmError(f"{args.out}: exists and is not an export's output (no {export.RECORD}): the export replaces its --out directory; name a new one")
    if generation.is_image_model(args.model, root):
        raise QllmError(f"{args.model}: {export.NO_IMAGE_MODEL}")
    model, tokenizer = generation.load(args.model, root)
    name = args.name or (args.model.removeprefix("models:/").split("@")[0].split("/")[0] if args.model.startswith("models:/") else Path(args.model).name)
    record = export.write_files(model, tokenizer, out, params, name, args.model, args.model, shown=args.out.rstrip("/"))
    for entry in record["files"]:
        print(f"{args.out.rstrip('/')}/{entry['file']}  {entry['type']}  {entry['bytes'] / 1e6:.1f} MB")
    if record["modelfile"]:
        print(f"{args.out.rstrip('/')}/{record['modelfile']}  (ollama create {name} -f {args.out.rstrip('/')}/{record['modelfile']})")
    return 0


def cmd_serve_openai(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _quiet_downloads()
    from qllm.serving import openai_api

    root = Path(args.project_dir).resolve()
    if bool(args.tls_cert) != bool(args.tls_key):
        raise QllmError("serve-openai: --tls-cert and --tls-key go together")
    tls = (str(project_path(args.tls_cert, root)), str(project_path(args.tls_key, root))) if args.tls_cert else None
    key = openai_api.read_key(args.api_key_env, args.api_key_file, root)
    limits = openai_api.Limits(args.time_limit, args.max_waiting, args.default_max_tokens).check()
    openai_api.check_host(args.host, key, tls, args.insecure)  # before the model loads: a refusal takes no time
    return openai_api.serve(args.model, root, args.host, args.port, key, args.model_name, tls, args.insecure, limits)


def cmd_compare(args: argparse.Namespace) -> int:
    _quiet_downloads()
    from qllm.registry import compare

    runs = compare.load_runs(Path(args.project_dir).resolve(), args.run_ids, args.last)
    compared = compare.table(runs, all_keys=args.all)
    print(json.dumps(compared, indent=2) if args.json else compare.render(compared))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qllm", description="QLLM pipeline: Prefect runs it, DVC versions it, MLflow tracks it.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline (stages whose inputs are unchanged are cache hits)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one param, e.g. dpo.beta=0.2 (repeatable)")
    run.add_argument("--params", action="append", default=[], metavar="FILE", help="YAML merged over params.yaml (repeatable), e.g. params/tiny.yaml")
    run.add_argument("--until", metavar="STAGE", help="run only up to and including STAGE")
    run.add_argument("--from-stage", metavar="STAGE", help="run STAGE and everything downstream; earlier stages must come from DVC's caches")
    run.add_argument("--force", action="append", default=[], metavar="STAGE", help="rerun STAGE even if it is up to date (repeatable)")
    run.add_argument("--record", action="store_true",
                     help="record a Prefect flow run and an MLflow run even when every stage is up to date (by default such a run only checks)")
    run.add_argument("--summary-json", metavar="FILE", help="write the run summary (stages, statuses, seconds, run id) as JSON")
    run.add_argument("--project-dir", default=".", metavar="DIR", help="project root; relative paths are relative to it (default: current directory)")
    run.set_defaults(func=cmd_run)

    lineage = sub.add_parser("lineage", help="a registered model's chain of stages back to the raw data (run ids, params, md5s)")
    lineage.add_argument("model_uri", metavar="MODEL_URI", help="models:/NAME@ALIAS or models:/NAME/VERSION, e.g. models:/qllm@champion")
    lineage.add_argument("--json", action="store_true", help="print the lineage as JSON")
    lineage.add_argument("--project-dir", default=".", metavar="DIR", help="project root; relative paths are relative to it (default: current directory)")
    lineage.set_defaults(func=cmd_lineage)

    generate = sub.add_parser("generate", help="answer a prompt with a registered model or a model directory (chat template)")
    generate.add_argument("--model", required=True, metavar="URI|PATH", help="models:/NAME@ALIAS, models:/NAME/VERSION or a model directory")
    generate.add_argument("--prompt", required=True, help="the user message")
    generate.add_argument("--system", help="an optional system message")
    generate.add_argument("--image", metavar="PATH", help="an image file to ask about (the multimodal model; docs/multimodal.md)")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens (default: 64)")
    generate.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default); >0: sample at temperature T")
    generate.add_argument("--seed", type=int, default=0, help="seed for sampling (default: 0)")
    generate.add_argument("--project-dir", default=".", metavar="DIR", help="project root; relative paths are relative to it (default: current directory)")
    generate.set_defaults(func=cmd_generate)

    export = sub.add_parser("export", help="write a registered model or a model directory as GGUF for llama.cpp and Ollama (with a Modelfile)")
    export.add_argument("--model", required=True, metavar="URI|PATH", help="models:/NAME@ALIAS, models:/NAME/VERSION or a model directory")
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write (replaced whole: a new one, or an earlier export's)")
    export.add_argument("--type", action="append", metavar="TYPE",
                        help="f16, q8_0, bf16, f32, or q4_k_m, q4_k_s, q5_k_m, q6_k (llama.cpp's quantizer: llama-cpp-python); repeatable (default: f16 and q8_0)")
    export.add_argument("--modelfile-type", metavar="TYPE", help="the file the Modelfile's FROM names (default: the last --type)")
    export.add_argument("--no-modelfile", action="store_true", help="no Ollama Modelfile (Ollama then reads the chat template from the GGUF)")
    export.add_argument("--system", help="the Modelfile's default system prompt")
    export.add_argument("--name", help="general.name and the files' prefix (default: the registered model's name or the directory's)")
    export.add_argument("--project-dir", default=".", metavar="DIR", help="project root; relative paths are relative to it (default: current directory)")
    export.set_defaults(func=cmd_export)

    serve_openai = sub.add_parser("serve-openai", help="serve a registered model or a model directory with OpenAI's chat completions API (docs/evaluation.md)")
    serve_openai.add_argument("--model", required=True, metavar="URI|PATH", help="models:/NAME@ALIAS, models:/NAME/VERSION or a model directory")
    serve_openai.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; any other needs an API key, and TLS or --insecure)")
    serve_openai.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    keys = serve_openai.add_mutually_exclusive_group()
    keys.add_argument("--api-key-env", metavar="VAR", help="require Authorization: Bearer KEY, KEY read from the environment variable VAR")
    keys.add_argument("--api-key-file", metavar="FILE", help="the same, KEY read from FILE (readable by its owner only)")
    serve_openai.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (chain); with --tls-key. Needed beyond this host")
    serve_openai.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    serve_openai.add_argument("--insecure", action="store_true", help="serve a --host beyond this machine with an API key but without TLS (a network you trust)")
    # openai_api.Limits' defaults (tests/qllm/test_openai_api.py compares them), written here: importing it costs every command
    serve_openai.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS",
                              help="seconds one answer may take to generate; it then ends with finish_reason length (default: %(default)g)")
    serve_openai.add_argument("--max-waiting", type=int, default=16, metavar="N",
                              help="requests that may wait for the model behind the one it answers; more get 429 with Retry-After (default: %(default)s)")
    serve_openai.add_argument("--default-max-tokens", type=int, default=512, metavar="N",
                              help="max_tokens of a request that gives none, at most the context left (default: %(default)s)")
    serve_openai.add_argument("--model-name", metavar="NAME", help="the model's id in /v1/models and answers (default: NAME@ALIAS, NAME/VERSION or the directory's name)")
    serve_openai.add_argument("--project-dir", default=".", metavar="DIR", help="project root; relative paths are relative to it (default: current directory)")
    serve_openai.set_defaults(func=cmd_serve_openai)

    compare = sub.add_parser("compare", help="params and metrics of MLflow runs side by side (only differing keys by default)")
    compare.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="pipeline or stage run ids (or unique prefixes of at least 6 characters)")
    compare.add_argument("--last", type=int, metavar="N", help="the last N pipeline runs instead of run ids")
    compare.add_argument("--all", action="store_true", help="every key, not only those whose values differ")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.add_argument("--project-dir", default=".", metavar="DIR", help="project root; relative paths are relative to it (default: current directory)")
    compare.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except QllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if argv is None:  # `qllm ...` itself: the process ends next
            exit_without_collecting()


if __name__ == "__main__":
    raise SystemExit(main())
