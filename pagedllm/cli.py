"""``pagedllm`` command line: ``serve``, ``service NAME``, ``prepare-model`` (the model and the CPU kernels).

Every engine/service setting of :class:`shared.config.Settings` is a flag
(``--max-model-len``, ``--block-size``, ...); unset flags fall back to ``PAGEDLLM_*``
environment variables, then to defaults.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import ValidationError

from shared.config import Settings

SKIP_FLAGS = {"model"}  # positional


def _flag_type(annotation: Any) -> tuple[Any, list | None]:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return _flag_type(args[0])
    if origin is typing.Literal:
        return str, list(get_args(annotation))
    if annotation in (int, float, str):
        return annotation, None
    return str, None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool_value(text: str) -> bool:
    """true/false (also 1/0, yes/no, on/off; any case) for a boolean flag.

    Raises:
        argparse.ArgumentTypeError: any other value (argparse names the flag and exits).
    """
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per Settings field (bools take true/false)."""
    for name, field in Settings.model_fields.items():
        if name in SKIP_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, type=_bool_value, nargs="?", const=True, default=None,
                                metavar="true|false", help=field.description)
            continue
        typ, choices = _flag_type(field.annotation)
        if name == "api_key":  # vLLM's --api-key K1 K2 ...: kept comma-separated
            parser.add_argument(flag, dest=name, nargs="+", action=_JoinKeys, default=None, help=field.description)
            continue
        parser.add_argument(flag, dest=name, type=typ, choices=choices, default=None, help=field.description)


class _JoinKeys(argparse.Action):
    """``--api-key K1 K2`` (or ``K1,K2``) as one comma-separated setting."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(values))


def validation_message(exc: ValidationError) -> str:
    """A pydantic error as one line: ``setting: reason; ...`` (the setting left out where the
    reason already names it, as the cross-setting checks do)."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        reason = error["msg"].removeprefix("Value error, ")
        parts.append(reason if not where or where in reason else f"{where}: {reason}")
    return "; ".join(parts)


def settings_from_args(args: argparse.Namespace, prefix: str = "pagedllm") -> Settings:
    """The settings of the command line (flags over ``PAGEDLLM_*`` over defaults).

    Raises:
        SystemExit: invalid settings, as one line ``<prefix>: invalid settings: ...`` (status 1).
    """
    values = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SystemExit(f"{prefix}: invalid settings: {validation_message(exc)}") from None


def cmd_prepare_model(args: argparse.Namespace) -> None:
    from pagedllm.launcher import model_info_or_exit

    prefix = "pagedllm prepare-model"
    settings = settings_from_args(args, prefix)
    info = model_info_or_exit(settings, prefix)
    print(f"model {info.name} ready at {info.path}")
    print(prepare_cpu_kernels(settings))


def prepare_cpu_kernels(settings: Settings) -> str:
    """Build the native CPU kernels into ``Settings.cache_dir / "kernels"`` for a CPU executor
    with ``native_cpu_kernels``, so that no executor compiles them at its first load (one that
    starts on a CPU with other features still builds its own there). Returns a line to print;
    a build that fails is not an error (the torch path serves; ``cpu_kernels_unavailable``
    is logged with the reason)."""
    from services.executor.device import resolve_device

    if not settings.native_cpu_kernels or resolve_device(settings.device).type != "cpu":
        return "native CPU kernels: not used with these settings"
    from kernels.cpu import native
    from shared.config import kernel_cache_dir

    lib = native.load(kernel_cache_dir(settings.cache_dir))
    if lib is None:
        return "native CPU kernels unavailable (see the cpu_kernels_unavailable log): the torch path will serve"
    return f"native CPU kernels ready at {lib._name}"


def cmd_service(args: argparse.Namespace) -> None:
    from pagedllm.launcher import run_one_service

    run_one_service(args.name, settings_from_args(args, f"pagedllm service {args.name}"))


#: serve's step token budget on a CPU when none is given: a long prompt is prefilled in chunks
#: of this size, so running streams stall for about one chunk (a 6,000-token prompt froze
#: them for 15 s in one 8,192-token step); a 512-row matmul runs as fast per row as a larger one
CPU_SERVE_MAX_NUM_BATCHED_TOKENS = 512


def serving_defaults(settings: Settings) -> Settings:
    """Online-serving defaults where they differ from the offline ``LLM``'s (as vLLM's
    ``serve`` does): on a CPU, ``max_num_batched_tokens`` 512 unless given (flag or env)."""
    from services.executor.device import resolve_device

    if "max_num_batched_tokens" in settings.model_fields_set or resolve_device(settings.device).type != "cpu":
        return settings
    return settings.model_copy(update={"max_num_batched_tokens": CPU_SERVE_MAX_NUM_BATCHED_TOKENS})


def _jetstream_store(cache_dir: Path) -> Path | None:
    """``<cache_dir>/jetstream``, held with a lock for this process's life; None (a temporary
    store) when another ``pagedllm serve`` holds it: two nats-servers on one store would
    corrupt it."""
    import fcntl

    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = open(cache_dir / "jetstream.lock", "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        print(f"pagedllm: another pagedllm serve uses {cache_dir / 'jetstream'}; this one keeps its batch jobs "
              "in a temporary store (give it another --cache-dir to keep them)", file=sys.stderr)
        return None
    _held_locks.append(lock)
    return cache_dir / "jetstream"


_held_locks: list = []


def cmd_run_batch(args: argparse.Namespace) -> None:
    """``pagedllm run-batch -i in.jsonl -o out.jsonl``: see ``pagedllm/run_batch.py``."""
    from pagedllm.run_batch import run_batch

    settings = settings_from_args(args, "pagedllm run-batch")
    overrides = {k: v for k, v in settings.model_dump(exclude_unset=True).items()}
    try:
        ok, failed = run_batch(args.input_file, args.output_file, **overrides)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedllm run-batch: {exc}") from None
    print(f"pagedllm run-batch: {ok} succeeded, {failed} failed; output in {args.output_file}")


def cmd_serve(args: argparse.Namespace) -> None:
    import urllib.request

    from pagedllm.launcher import model_info_or_exit, pinned_settings
    from pagedllm.supervisor import CrashLoopError, ServiceProcesses
    from shared.logging import configure_logging, get_logger
    from shared.nats_server import EmbeddedNats

    settings = serving_defaults(settings_from_args(args))
    configure_logging(settings.log_level, service="serve")
    # SIGTERM stops the stack like Ctrl-C: children are in their own sessions and would outlive us
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    info = model_info_or_exit(settings, "pagedllm")
    # JetStream's file store under the cache directory: batch jobs survive a restart of serve
    nats_server = (EmbeddedNats(new_session=True, store_dir=_jetstream_store(settings.cache_dir))
                   if not settings.nats_url else None)
    procs: ServiceProcesses | None = None
    health = f"http://{settings.host}:{settings.port}/health"
    ready = False
    try:  # a Ctrl-C while starting, too, stops what was started (each in its own session)
        url = nats_server.start().url if nats_server is not None else settings.nats_url
        procs = ServiceProcesses(pinned_settings(settings, info, url))
        procs.start()
        while True:
            if nats_server is not None and nats_server.restart_if_dead():
                get_logger("pagedllm.serve").warning("nats_server_restarted", port=nats_server.port)
            try:
                procs.supervise()
            except CrashLoopError as exc:
                raise SystemExit(f"pagedllm: {exc}") from None
            if not ready:
                try:
                    with urllib.request.urlopen(health, timeout=1) as resp:
                        ready = resp.status == 200
                except OSError:
                    pass
                if ready:
                    print(f"pagedllm: serving {info.name} on http://{settings.host}:{settings.port}/v1 "
                          f"(NATS {url})", flush=True)  # its owner's terminal: the token lets them add services
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C or SIGTERM (make forwards one) must not cut the cleanup short: the
        # services and the embedded NATS live in their own sessions and would be orphaned.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if procs is not None:
                procs.stop()
        finally:
            if nats_server is not None:
                nats_server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API with every service")
    serve.add_argument("model", nargs="?", default=None, help="Hugging Face model directory (default: SmolLM2)")
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    service = sub.add_parser("service", help="run one service against a NATS server")
    service.add_argument("name", choices=["scheduler", "tokenizer", "detokenizer", "executor", "gateway", "batch"])
    service.add_argument("--model", default=None)
    add_settings_flags(service)
    service.set_defaults(func=cmd_service)

    batch = sub.add_parser("run-batch", help="run an OpenAI batch file offline (vLLM's run-batch)")
    batch.add_argument("-i", "--input-file", required=True, type=Path, help="OpenAI batch input (.jsonl)")
    batch.add_argument("-o", "--output-file", required=True, type=Path, help="where the output lines go")
    batch.add_argument("--model", default=None)
    add_settings_flags(batch)
    batch.set_defaults(func=cmd_run_batch)

    prep = sub.add_parser("prepare-model", help="convert the default model once (or check a directory) and build the CPU kernels")
    prep.add_argument("model", nargs="?", default=None)
    add_settings_flags(prep)
    prep.set_defaults(func=cmd_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
