"""The ``shoal`` command: serve a model, generate once, run one actor, or run a benchmark.

shoal serve [MODEL]            the OpenAI-compatible server (default: SmolLM2-135M-Instruct)
shoal generate [MODEL] -p TEXT one completion, printed
shoal actor KIND MODEL ...     one actor process joining a NATS deployment (multi-host)
shoal probe KIND [ID]          exit 0 if that actor of a NATS deployment is ready (for probes)
shoal status [--json]          every actor of a NATS deployment: state, load, KV, faults
shoal top                      the same, redrawn in the terminal
shoal bench NAME [ARGS...]     a benchmark from bench/ (throughput, serve, scheduler, bus, …)
shoal nats-auth --namespace NS the nats-server authorization config: one user per actor role
  [--cluster-auth-file PATH]   and the cluster routes' user and routes (include in cluster {})
shoal nats-init --namespace NS create its JetStream buckets and stream (as its provisioner)
shoal lora push NAME PATH      put a LoRA adapter into a deployment's object store

NATS credentials: $SHOAL_NATS_USER and $SHOAL_NATS_PASSWORD, or --nats-user NAME with
--nats-password-file PATH; never in --nats-url (a process listing would show them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

from shoal.bus.nats_ops.credentials import (
    CredentialsError,
    NatsCredentials,
    resolve_credentials,
)
from shoal.bus.nats_ops.permissions import ROLES
from shoal.config.deployment import ShoalConfig
from shoal.deploy.arguments import add_engine_arguments, config_from_namespace, option_default
from shoal.deploy.lora_push import add_lora_push_arguments, run_lora_push
from shoal.deploy.model_source import DEFAULT_MODEL_NAME, DEMO_MODEL_NAME, ModelNotFoundError
from shoal.deploy.nats_init import add_nats_init_arguments, run_nats_init
from shoal.deploy.probe import add_probe_arguments, probed_id, run_probe
from shoal.deploy.restart_cli import add_restart_arguments, run_restart
from shoal.deploy.status_cli import add_status_arguments, run_status, run_top
from shoal.tracing.exporter import TracingUnavailable
from shoal.tracing.setup import check_tracing

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
ACTOR_KINDS = ("worker", "engine", "gateway", "recovery", "tier")
# Benchmark names that are not file names: `shoal bench throughput` is the end-to-end one.
LOG_LEVEL_HELP = "DEBUG, INFO, WARNING or ERROR"
MODEL_HELP = (
    f"a Hugging Face model directory, a GGUF file (or a directory holding one), or a built-in "
    f"model: {DEFAULT_MODEL_NAME} (the default) or {DEMO_MODEL_NAME}"
)
BENCH_ALIASES = {"throughput": "throughput_e2e", "runner-throughput": "throughput"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="shoal: an LLM serving engine of actors on a message bus.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--log-level", default="INFO", help=LOG_LEVEL_HELP)
    # The same flag after the command name (``shoal serve --log-level DEBUG``).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", parents=[common], help="serve a model over HTTP (OpenAI API) and NATS"
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help=MODEL_HELP,
    )
    _add_http_arguments(serve)
    _add_credential_arguments(serve)
    add_engine_arguments(serve)

    generate = commands.add_parser(
        "generate", parents=[common], help="generate one completion and print it"
    )
    generate.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    generate.add_argument("--prompt", "-p", required=True, help="the prompt text")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    add_engine_arguments(generate)

    actor = commands.add_parser(
        "actor", parents=[common], help="run one actor process of a NATS deployment"
    )
    actor.add_argument("kind", choices=ACTOR_KINDS, help="which actor")
    actor.add_argument(
        "model", help="Hugging Face directory, GGUF file or built-in name (the same on every host)"
    )
    actor.add_argument(
        "--id",
        dest="actor_id",
        default=None,
        help="actor id: worker-D-T, engine-D, gateway-N, recovery-0 or a KV tier's "
        "(kv-cpu, kv-cpu-fs0, ...) (default: rank 0's, the CPU tier's)",
    )
    actor.add_argument(
        "--tp-init-method",
        default=None,
        help="torch.distributed rendezvous of the TP group, tcp://HOST:PORT",
    )
    actor.add_argument(
        "--ep-init-method",
        default=None,
        help="torch.distributed rendezvous of the expert-parallel group (every data-parallel "
        "rank's worker), tcp://HOST:PORT",
    )
    _add_http_arguments(actor)
    _add_credential_arguments(actor)
    add_engine_arguments(actor)

    probe = commands.add_parser(
        "probe", parents=[common], help="exit 0 if an actor of a NATS deployment is ready"
    )
    add_probe_arguments(probe, ACTOR_KINDS, option_default("namespace"))

    _add_status_commands(commands, common)
    _add_bench_command(commands, common)
    _add_nats_auth_command(commands, common)
    init = commands.add_parser(
        "nats-init", parents=[common], help="create a namespace's JetStream buckets and stream"
    )
    add_nats_init_arguments(init)
    _add_credential_arguments(init)
    _add_lora_command(commands, common)
    return parser  # fmt: skip


def _add_bench_command(commands: Any, common: argparse.ArgumentParser) -> None:
    bench = commands.add_parser("bench", parents=[common], help="run a benchmark from bench/")
    bench.add_argument("name", help="benchmark name: " + ", ".join(_bench_names()))
    bench.add_argument(
        "bench_args", nargs=argparse.REMAINDER,
        help="its own arguments, and --plot FILE: its figures as a PNG (needs shoal[bench])",
    )  # fmt: skip


def _add_status_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    status = commands.add_parser(
        "status", parents=[common], help="every actor of a NATS deployment, from its heartbeats"
    )
    add_status_arguments(status, option_default("namespace"), top=False)
    top = commands.add_parser("top", parents=[common], help="shoal status, redrawn live")
    add_status_arguments(top, option_default("namespace"), top=True)
    restart = commands.add_parser(
        "restart", parents=[common], help="restart a NATS deployment's actors, one at a time"
    )
    add_restart_arguments(restart, option_default("namespace"))


def _add_lora_command(commands: Any, common: argparse.ArgumentParser) -> None:
    lora = commands.add_parser("lora", parents=[common], help="LoRA adapters of a deployment")
    lora_commands = lora.add_subparsers(dest="lora_command", required=True)
    push = lora_commands.add_parser(
        "push", parents=[common], help="put an adapter folder into the deployment's object store"
    )
    add_lora_push_arguments(push)
    _add_credential_arguments(push)


def _add_nats_auth_command(commands: Any, common: argparse.ArgumentParser) -> None:
    auth = commands.add_parser(
        "nats-auth", parents=[common], help="print the nats-server authorization config"
    )
    auth.add_argument("--namespace", default="shoal", help="the deployment's subject namespace")
    auth.add_argument(
        "--credentials-dir",
        type=Path,
        default=Path("shoal-nats-credentials"),
        help="where each role's password file is (written 0600 when missing)",
    )
    auth.add_argument(
        "--roles", nargs="+", choices=list(ROLES), default=None, metavar="ROLE", help="(all)"
    )
    auth.add_argument(
        "--gateway-may-command",
        action="store_true",
        help="let the gateway send recovery commands (POST /fault_tolerance/apply)",
    )
    auth.add_argument(
        "--cluster-auth-file",
        type=Path,
        default=None,
        help="also write (0600) the cluster routes' user and route URLs with its password "
        "(route.password), for every node to include inside its cluster {} block",
    )
    auth.add_argument(
        "--routes",
        nargs="+",
        default=None,
        metavar="HOST:PORT",
        help="every node's route address (default: nats-0:6222 nats-1:6222 nats-2:6222, "
        "deploy/nats's; Kubernetes: nats-N.nats:6222)",
    )


def _add_credential_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("NATS credentials (else $SHOAL_NATS_USER/$SHOAL_NATS_PASSWORD)")
    g.add_argument("--nats-user", default=None, help="NATS user name")
    g.add_argument("--nats-password-file", default=None, help="file holding its password")


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument(
        "--sse-keep-alive-s",
        type=float,
        default=None,
        help="seconds without output before a stream gets a keep-alive comment (default 15; "
        "0: never)",
    )
    g.add_argument(
        "--shutdown-delay-s",
        type=float,
        default=0.0,
        help="on stop or restart, answer /health 503 but keep serving this long before closing "
        "the port, so a load balancer's health checks take this gateway out first (Kubernetes: "
        "more than the readiness probe's period times its failure threshold)",
    )


def _bench_names() -> list[str]:
    stems = {p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_")}
    return sorted(stems | BENCH_ALIASES.keys())


def _config(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ShoalConfig:
    try:
        config = config_from_namespace(ns, ns.model)
        check_tracing(config.observability_config)
    except ModelNotFoundError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, TracingUnavailable) as exc:
        parser.error(str(exc))  # exits with status 2
    return config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if ns.command == "bench":
        return _run_bench(parser, ns.name, ns.bench_args)
    if ns.command == "probe":
        try:
            actor_id = probed_id(ns)
        except ValueError as exc:
            parser.error(str(exc))
        return asyncio.run(run_probe(ns, actor_id))
    if ns.command == "status":
        return asyncio.run(run_status(ns))
    if ns.command == "restart":
        return asyncio.run(run_restart(ns))
    if ns.command == "top":
        try:
            return asyncio.run(run_top(ns))
        except KeyboardInterrupt:
            return 0
    if ns.command == "nats-auth":
        return _nats_auth(parser, ns)
    if ns.command == "nats-init":
        return asyncio.run(run_nats_init(ns))
    if ns.command == "lora":
        return asyncio.run(run_lora_push(ns))
    try:
        return _run(parser, ns)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are set (the demo build)
        print("shoal: interrupted", file=sys.stderr)
        return 130


def _run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    if ns.command in ("serve", "actor"):  # before the model is looked at
        _credentials(parser, ns)
    config = _config(parser, ns)
    if ns.command == "serve":
        from shoal.deploy.local import check_embedded_server

        try:
            check_embedded_server(config)
        except ValueError as exc:
            parser.error(str(exc))
        return asyncio.run(_serve(config, ns))
    if ns.command == "generate":
        return _generate(config, ns)
    return asyncio.run(_actor(parser, config, ns))


async def _serve(config: ShoalConfig, ns: argparse.Namespace) -> int:
    from shoal.deploy.local import HttpOptions, serve_local

    stop = _stop_on_signals()
    credentials = ns.credentials if config.bus_config.nats_url else None
    await serve_local(config, HttpOptions.from_namespace(ns), stop, credentials=credentials)
    return 0


def _credentials(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """``ns.credentials`` from the flags or the environment (``--nats-url`` refuses URLs
    holding them: ``deploy.arguments``)."""
    try:
        ns.credentials = resolve_credentials(ns.nats_user, ns.nats_password_file)
    except CredentialsError as exc:
        parser.error(str(exc))


def _nats_auth(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from shoal.deploy.nats_auth import cluster_auth_config, nats_auth_config, write_private
    from shoal.deploy.nats_config import route_hosts

    if ns.routes is not None and ns.cluster_auth_file is None:
        parser.error("--routes goes with --cluster-auth-file")
    try:
        text = nats_auth_config(
            ns.namespace, ns.credentials_dir, ns.roles, gateway_may_command=ns.gateway_may_command
        )
        if ns.cluster_auth_file is not None:
            routes = ns.routes or route_hosts()
            cluster = cluster_auth_config(ns.namespace, ns.credentials_dir, routes)
            write_private(ns.cluster_auth_file, cluster)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print(text, end="")
    return 0


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


def _generate(config: ShoalConfig, ns: argparse.Namespace) -> int:
    from shoal import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            seed=config.model_config.seed,
        )
    except ValueError as exc:
        print(f"shoal generate: error: {exc}", file=sys.stderr)
        return 2
    with LLM(config=config.replace(bus="memory")) as llm:
        output = llm.generate(ns.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


async def _actor(
    parser: argparse.ArgumentParser, config: ShoalConfig, ns: argparse.Namespace
) -> int:
    from shoal.bus.runtime.run_actor import serve
    from shoal.deploy.actors import actor_target

    nats_url = config.bus_config.nats_url
    if nats_url is None:
        parser.error("shoal actor needs --nats-url (the deployment's NATS servers)")
    try:
        target, kwargs = actor_target(ns.kind, config, ns.actor_id, ns)
    except ValueError as exc:
        parser.error(str(exc))
    credentials: NatsCredentials | None = ns.credentials
    return await serve(target, nats_url, kwargs, credentials.bus_options() if credentials else {})


def _run_bench(parser: argparse.ArgumentParser, name: str, bench_args: list[str]) -> int:
    path = BENCH_DIR / f"{BENCH_ALIASES.get(name, name)}.py"
    if not path.is_file():
        parser.error(f"unknown benchmark {name!r}; choose from {', '.join(_bench_names())}")
    bench_args, plot_path = _take_plot_flag(parser, bench_args)
    sys.argv = [str(path), *bench_args]
    output = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, output) if plot_path else sys.stdout):
        try:
            runpy.run_path(str(path), run_name="__main__")
            status = 0
        except SystemExit as exc:
            status = int(exc.code or 0) if not isinstance(exc.code, str) else 1
    if plot_path is not None:
        return _plot_bench(name, output.getvalue(), plot_path) or status
    return status


def _take_plot_flag(
    parser: argparse.ArgumentParser, bench_args: list[str]
) -> tuple[list[str], Path | None]:
    """``--plot FILE`` (shoal's, not the benchmark's) taken out of the benchmark's arguments."""
    for index, arg in enumerate(bench_args):
        if arg == "--plot" or arg.startswith("--plot="):
            value = arg.partition("=")[2] or (bench_args[index + 1 : index + 2] or [""])[0]
            if not value:
                parser.error("--plot needs a file name")
            rest = bench_args[:index] + bench_args[index + (1 if "=" in arg else 2) :]
            return rest, Path(value)
    return bench_args, None


class _Tee(io.TextIOBase):
    """Writes to every stream it is given (the terminal, and a buffer read for --plot)."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _plot_bench(name: str, output: str, path: Path) -> int:
    """Draw the benchmark's result (its last JSON line) into ``path``; 1 if it cannot."""
    sys.path.insert(0, str(BENCH_DIR.parent))
    from bench.plot import draw, last_result, panels

    result = last_result(output)
    if result is None:
        print(f"shoal bench: {name} printed no JSON result to plot", file=sys.stderr)
        return 1
    try:
        draw(panels(result), path, f"shoal bench {name}")
    except ImportError as exc:
        print(f"shoal bench: --plot needs matplotlib (pip install 'shoal[bench]'): {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"shoal bench: figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
