"""The docs' screenshots of the MLflow UI, the Prefect UI and TensorBoard, taken in a real headless
browser against a real run, so they cannot drift from what the tools show.

    make docs-screenshots                       # after `make run`; writes docs/images/*.png
    python docs/screenshots.py --project DIR --out DIR

It starts the project's services as `make serve` does (a Prefect server and worker, the MLflow UI;
on free ports, or the ones `make serve` already runs), runs `qllm run` against that Prefect
server (stages DVC has cached are restored, so after `make run` this takes seconds, and the Prefect
UI has a real flow run to show), starts TensorBoard on the run's event files, and photographs:

    mlflow-runs.png       the experiment's runs table, where the runs link of `make serve` lands,
                          with held-out metric columns ticked (Source and Models unticked)
    mlflow-metrics.png    the pretrain stage run's metric charts
    mlflow-registry.png   the registered model's versions and aliases
    mlflow-compare.png    MLflow's compare view of the last two pipeline runs: the first, and a
                          second with one override (`--compare-set`, default dpo.beta=0.5)
    prefect-flow-run.png  the flow run: its task runs on the timeline
    tensorboard.png       TensorBoard's scalars of the training stages

Next to the images, `screenshots.json` records each page's final URL and the texts the script
waited for, and for the compare view the page's visible text (what the test reads). The browser is Chromium driven by Playwright: `QLLM_CHROMIUM` names its executable,
else the first of chromium / chromium-browser / google-chrome on PATH (Debian: `apt-get install
chromium`), else Playwright's own (`playwright install chromium`). Everything binds 127.0.0.1 and
is stopped afterwards, also on errors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the project's packages from this checkout
    sys.path.insert(0, str(REPO))

from pipelines.core.errors import QllmError  # noqa: E402
from pipelines.core.run import tracking  # noqa: E402
from qllm.services import serve  # noqa: E402
from qllm.services.local_api import free_port, wait_http  # noqa: E402

VIEWPORT = {"width": 1400, "height": 860}
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
PAGE_TIMEOUT_MS = 60_000


def chromium_executable() -> str | None:
    """The Chromium to drive: QLLM_CHROMIUM, else one on PATH, else None (Playwright's own)."""
    named = os.environ.get("QLLM_CHROMIUM")
    if named:
        if not Path(named).is_file():
            raise QllmError(f"QLLM_CHROMIUM={named!r} is not a file; name a Chromium executable")
        return named
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


@contextmanager
def services(root: Path):
    """The project's Prefect server + worker and MLflow UI: the running `make serve` ones, or
    started here on free ports and stopped on exit."""
    record = serve.read_record(root)
    if record["services"] and all(serve._alive(s["pid"]) for s in record["services"].values()):
        yield record
        return
    record = serve.start(root, prefect_port=0, mlflow_port=0)
    try:
        yield record
    finally:
        serve.stop(root)


@contextmanager
def tensorboard(root: Path):
    """TensorBoard on the project's event files (tensorboard/), on a free 127.0.0.1 port."""
    logdir = root / "tensorboard"
    if not logdir.is_dir():
        raise QllmError(f"{logdir} does not exist: a training stage writes it (extension `tensorboard`)")
    port = free_port()
    log = root / serve.STATE_DIR / "tensorboard.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen([str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                                   cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, process, "TensorBoard", None, hint=f"; see {log}")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def run_pipeline(root: Path, record: dict, args: list[str]) -> None:
    """`qllm run --record` against the served Prefect API: a flow run for the Prefect UI to show
(recorded also when every stage is up to date)."""
    env = {**serve.service_env(root, record["prefect_api_url"]), "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    done = subprocess.run([str(Path(sys.executable).parent / "qllm"), "run", "--record", *args], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise QllmError(f"`qllm run` failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def latest_flow_run(api_url: str) -> dict:
    request = urllib.request.Request(f"{api_url}/flow_runs/filter", data=json.dumps({"sort": "START_TIME_DESC", "limit": 1}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        runs = json.load(response)
    if not runs:
        raise QllmError(f"the Prefect server at {api_url} has no flow run")
    return runs[0]


def mlflow_targets(root: Path) -> dict:
    """The experiment, the newest pretrain stage run and the registered model, read from mlflow.db."""
    uri = f"sqlite:///{root / 'mlflow.db'}"
    experiment = tracking.experiment_id(root, uri=uri)
    client = tracking.client(root, uri=uri)
    runs = client.search_runs([experiment], "tags.`qllm.stage` = 'pretrain'", max_results=1, order_by=["attributes.start_time DESC"])
    if not runs:
        raise QllmError(f"{root / 'mlflow.db'} has no pretrain run in experiment {tracking.experiment_name()!r}; run `make run` first")
    models = client.search_registered_models(max_results=1)
    pipelines = client.search_runs([experiment], "tags.`qllm.kind` = 'pipeline'", max_results=2, order_by=["attributes.start_time DESC"])
    return {"experiment": experiment, "pretrain_run": runs[0].info.run_id, "model": models[0].name if models else None,
            "pipeline_runs": [(r.info.run_id, r.info.run_name) for r in reversed(pipelines)]}  # fmt: skip


def compare_url(ui: str, experiment: str, run_ids: list[str]) -> str:
    """MLflow's compare view of `run_ids` (MLflow 3: `#/compare-runs?runs=[...]&experiments=[...]`)."""
    from urllib.parse import quote

    return f"{ui}/#/compare-runs?runs={quote(json.dumps(run_ids))}&experiments={quote(json.dumps([experiment]))}&workflowType=machine_learning"


GRIDS_JS = """() => Array.from(document.querySelectorAll('[role=grid]')).map(grid =>
    Array.from(grid.querySelectorAll('[role=rowgroup] > div')).map(cell => [cell.style.top, cell.style.left, cell.innerText]))"""
"""The cells MLflow's virtualised grids (the compare view's metrics: one grid of names, one of
values) have rendered, as [top, left, text]: rows line up by `top`."""


def grid_rows(grids: list[list[list[str]]]) -> dict[str, list[str]]:
    """The compare view's metrics table from `GRIDS_JS`: name -> the values shown, one per run (the
    names grid and the values grid joined on their rows' positions)."""
    if len(grids) < 2:
        return {}
    names = {top: text for top, _, text in grids[0]}
    values: dict[str, list[tuple[float, str]]] = {}
    for top, left, text in grids[1]:
        values.setdefault(top, []).append((float(left.removesuffix("px") or 0), text))
    return {names[top]: [text for _, text in sorted(cells)] for top, cells in values.items() if top in names}


def shot_list(targets: dict, ui: str, prefect_ui: str, flow_run: dict, board: str, compare_set: str) -> list[dict]:
    """What to photograph: each page's file, URL, the texts to wait for and what to do there
    (`targets` from `mlflow_targets`, the UIs' URLs, the flow run to show, the override compared)."""
    shots = [
        {"file": "mlflow-runs.png", "url": tracking.ui_runs_url(ui, targets["experiment"]), "wait_for": ["matching runs", targets["pipeline_runs"][-1][1]],
         "close": ["Close"], "columns": ["Source", "Models", "heldout/exact_match/sft", "heldout/exact_match/dpo", "val/loss/dpo"],
         "read": True},
        {"file": "mlflow-compare.png", "url": compare_url(ui, targets["experiment"], [run_id for run_id, _ in targets["pipeline_runs"]]),
         "wait_for": [name for _, name in targets["pipeline_runs"]] + [compare_set.split("=", 1)[0]], "close": ["Close"], "read": True,
         "click": [("switch", "Parameters - Show diff only"), ("button", "Visualizations")],
         "scroll_to": "Parameters", "settle_ms": 2000},
        {"file": "mlflow-metrics.png", "url": f"{ui}/#/experiments/{targets['experiment']}/runs/{targets['pretrain_run']}/model-metrics?workflowType=machine_learning",
         "wait_for": ["train/loss"], "close": ["Close"], "settle_ms": 3000},
        {"file": "prefect-flow-run.png", "url": f"{prefect_ui}/runs/flow-run/{flow_run['id']}", "wait_for": [flow_run["name"], "Completed"], "settle_ms": 3000},
        {"file": "tensorboard.png", "url": f"{board}/?runFilter=pretrain/{targets['pretrain_run']}&tagFilter=loss#timeseries",
         "wait_for": ["train/loss", "val/loss"], "close": ["Close"], "settle_ms": 3000},
    ]  # fmt: skip
    if targets["model"]:
        shots.insert(2, {"file": "mlflow-registry.png", "url": f"{ui}/#/models/{targets['model']}?workflowType=machine_learning", "wait_for": ["champion"], "close": ["Close"]})
    return shots


def shoot(shots: list[dict], out: Path) -> list[dict]:
    """Open each shot's URL, wait for its texts, close what covers the page, save the PNG."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    taken = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_executable(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            for shot in shots:
                page.goto(shot["url"])
                for text in shot["wait_for"]:
                    try:
                        page.get_by_text(text).filter(visible=True).first.wait_for(state="visible")
                    except PlaywrightError as exc:
                        shown = out / f"failed-{shot['file']}"
                        page.screenshot(path=shown)
                        raise QllmError(f"{shot['file']}: {text!r} did not appear on {page.url} within {PAGE_TIMEOUT_MS // 1000} s; "
                                        f"what the page showed: {shown}") from exc  # fmt: skip
                for label in shot.get("close", []):
                    button = page.get_by_role("button", name=label)
                    if button.count():
                        button.first.click()
                if shot.get("columns"):  # the runs table's Columns menu: tick (or untick) each by its name
                    page.get_by_role("button", name="Columns").first.click()
                    search = page.get_by_placeholder("Search columns")
                    for name in shot["columns"]:
                        search.fill(name)
                        page.get_by_text(name, exact=True).last.click()
                    page.keyboard.press("Escape")
                for role, name in shot.get("click", []):  # switches to turn on, sections to fold (the compare view's)
                    page.get_by_role(role, name=name).first.click()
                if shot.get("scroll_to"):
                    page.get_by_text(shot["scroll_to"], exact=True).first.scroll_into_view_if_needed()
                    page.mouse.wheel(0, 0)
                page.wait_for_timeout(shot.get("settle_ms", 1000))  # charts draw after their data arrives
                page.screenshot(path=out / shot["file"])
                taken.append({"file": shot["file"], "url": page.url, "found": shot["wait_for"]}
                             | ({"text": page.inner_text("body"), "grids": page.evaluate(GRIDS_JS)} if shot.get("read") else {}))  # fmt: skip
        finally:
            browser.close()
    return taken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/screenshots.py", description=__doc__.split("\n")[0])
    parser.add_argument("--project", type=Path, default=REPO, help="a project where `make run` has run (default: this checkout)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--run-args", default="", help="extra arguments for `qllm run` (e.g. '--set train.max_steps=2')")
    parser.add_argument("--compare-set", default="dpo.beta=0.5", metavar="KEY=VALUE",
                        help="the override of the second run, compared with the first (default dpo.beta=0.5)")
    args = parser.parse_args(argv)
    root, out = args.project.resolve(), args.out.resolve()
    try:
        if not (root / "dvc.yaml").is_file():
            raise QllmError(f"{root} is not a qllm project (it has no dvc.yaml)")
        with ExitStack() as stack:
            record = stack.enter_context(services(root))
            started = time.monotonic()
            run_pipeline(root, record, args.run_args.split())
            run_pipeline(root, record, [*args.run_args.split(), "--set", args.compare_set])
            print(f"qllm run, and again with {args.compare_set}, against the served Prefect API: {time.monotonic() - started:.0f} s")
            board = stack.enter_context(tensorboard(root))
            targets = mlflow_targets(root)
            ui = record["services"]["mlflow-ui"]["url"]
            shots = shot_list(targets, ui, record["services"]["prefect-server"]["url"], latest_flow_run(record["prefect_api_url"]), board, args.compare_set)
            out.mkdir(parents=True, exist_ok=True)
            taken = shoot(shots, out)
        (out / "screenshots.json").write_text(json.dumps(taken, indent=2) + "\n")
    except QllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for shot in taken:
        print(f"{out / shot['file']}  <- {shot['url']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
