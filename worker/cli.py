"""``kvpool worker ...``: commands of the inference worker.

* ``make-tiny-model DIR``: write the deterministic tiny random Llama model and tokenizer
  that tests and the local demo run;
* ``fetch-model --repo R --revision V --dir D``: download a Hugging Face snapshot into the
  cache and link it at D (a pod's init container; the token comes from ``HF_TOKEN``);
* ``generate --model DIR PROMPT...``: run prompts through the engine and print the text,
  a quick check that a model directory loads and generates;
* ``serve --model DIR``: the OpenAI-compatible worker server (``--engine sim`` for the
  simulated engine);
* ``drain --port P``: ask the worker on this host to stop taking requests and wait until
  those in flight are done (a pod's preStop hook); ``undrain --port P`` takes it back;
  both send the admin token derived from the pool secret (``--pool-secret``,
  ``--pool-secret-file`` or their ``KVPOOL_*`` variables, as the worker itself reads them);
* ``admin-token``: print the admin token of the pool secret given the same way, for an
  operator's ``Authorization: Bearer`` header;
* ``sim-fleet --model DIR --count N``: N simulated workers in one process, on consecutive
  ports.

Every ``serve`` flag can also come from a ``KVPOOL_*`` variable (``--max-num-seqs`` from
``KVPOOL_MAX_NUM_SEQS``); a flag wins over the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from kvpool.cli import run_command
from kvpool.settings_cli import add_settings_arguments, build_settings, settings_values

from .config import ModelLoadError
from .tiny import ARCHITECTURES

ENV_PREFIX = "KVPOOL_"


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    path = make_tiny_model(args.dir, seed=args.seed, architecture=args.architecture)
    print(f"wrote a tiny random {args.architecture} model to {path}")
    return 0


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from huggingface_hub.utils import disable_progress_bars

    from .fetch import fetch_model

    disable_progress_bars()
    snapshot = fetch_model(
        args.repo,
        args.revision,
        args.dir,
        cache_dir=args.cache_dir,
        include=args.include,
        exclude=args.exclude,
    )
    # the commit is the snapshot's name: the log says which one a branch resolved to
    print(f"fetched {args.repo} at {args.revision} (commit {snapshot.name}): {args.dir}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import EngineConfig, LLMEngine
    from .sequence import SamplingParams

    config = EngineConfig(
        num_blocks=args.num_blocks, device=args.device, dtype=args.dtype, seed=args.seed
    )
    engine = LLMEngine.from_pretrained(args.model, config)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    for done in engine.generate(args.prompts, params):
        line = {"text": done.text, "token_ids": done.token_ids, "finish": done.finish_reason}
        print(json.dumps(line, ensure_ascii=False))
    return 0


def _pool_secret(args: argparse.Namespace) -> str | None:
    """The pool secret from ``--pool-secret``/``--pool-secret-file``, else from
    ``KVPOOL_POOL_SECRET``/``KVPOOL_POOL_SECRET_FILE`` (as ``serve`` reads it)."""
    from .settings import read_secret_file

    if args.pool_secret or args.pool_secret_file:  # a flag wins over both variables
        secret, path = args.pool_secret, args.pool_secret_file
    else:
        secret = os.environ.get(f"{ENV_PREFIX}POOL_SECRET")
        path = os.environ.get(f"{ENV_PREFIX}POOL_SECRET_FILE")
    if secret and path:
        raise ValueError("give the pool secret or its file, not both")
    return read_secret_file(path) if path else secret or None


def _admin_post(args: argparse.Namespace, action: str) -> tuple[int, dict[str, Any]]:
    """POST ``/{action}`` to the worker with the admin token (if there is a pool secret):
    (HTTP status, JSON body); status 0 when the worker cannot be reached."""
    import urllib.error
    import urllib.request

    from kvpool.signing import admin_token

    secret = _pool_secret(args)
    headers = {"Authorization": f"Bearer {admin_token(secret)}"} if secret else {}
    url = f"http://{args.host}:{args.port}/{action}"
    request = urllib.request.Request(url, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return exc.code, body
    except (urllib.error.URLError, OSError) as exc:
        print(f"kvpool worker {action}: {url}: {exc}", file=sys.stderr)
        return 0, {}


def _cmd_drain(args: argparse.Namespace) -> int:
    status, body = _admin_post(args, "drain")
    if status == 0:
        return 1
    print(json.dumps(body))
    return 0 if status == 200 and body.get("drained") else 1


def _cmd_undrain(args: argparse.Namespace) -> int:
    status, body = _admin_post(args, "undrain")
    if status == 0:
        return 1
    print(json.dumps(body))
    return 0 if status == 200 else 1


def _cmd_admin_token(args: argparse.Namespace) -> int:
    from kvpool.signing import admin_token, check_secret

    secret = _pool_secret(args)
    if not secret:
        raise ValueError(
            f"no pool secret: give --pool-secret, --pool-secret-file or {ENV_PREFIX}POOL_SECRET"
        )
    check_secret(secret)
    print(admin_token(secret))
    return 0


def _admin_arguments(parser: argparse.ArgumentParser, *, target: bool = True) -> None:
    if target:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--pool-secret", default=None, help=f"the pool secret; env {ENV_PREFIX}POOL_SECRET"
    )
    parser.add_argument(
        "--pool-secret-file",
        default=None,
        help=f"a file holding the pool secret; env {ENV_PREFIX}POOL_SECRET_FILE",
    )


def _settings_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    from .settings import WorkerSettings

    add_settings_arguments(parser, WorkerSettings, ENV_PREFIX, skip)


def _settings_values(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    from .settings import WorkerSettings

    return settings_values(args, WorkerSettings, ENV_PREFIX, skip)


def _settings(values: dict[str, Any]) -> Any:
    from .settings import WorkerSettings

    return build_settings(WorkerSettings, values)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .serving import serve

    settings = _settings(_settings_values(args))
    serve(settings, log_level="debug" if args.verbose else "info")
    return 0


def _cmd_sim_fleet(args: argparse.Namespace) -> int:
    from .serving import serve_many

    if args.count < 1 or args.processes < 1:
        raise ValueError("--count and --processes must be at least 1")
    replay_base = _replay_base_port(args)
    base = _settings_values(args, skip=_FLEET_SKIP)
    fleet = []
    for i in range(args.count):
        values = {**base, "engine": "sim", "port": args.base_port + i}
        if args.kv_events_base_port:
            host = base.get("host", "127.0.0.1")
            values["kv_events_endpoint"] = f"tcp://{host}:{args.kv_events_base_port + i}"
            if replay_base:
                values["kv_events_replay_endpoint"] = f"tcp://{host}:{replay_base + i}"
        fleet.append(_settings(values))
    for s in fleet:
        line = {
            "url": f"http://{s.host}:{s.port}",
            "kv_events_endpoint": s.kv_events_endpoint,
            "kv_events_replay_endpoint": s.kv_events_replay_endpoint,
        }
        print(json.dumps(line), flush=True)
    # One process is one GIL: --processes N spreads the workers over N processes (this
    # one and N-1 children), so a fleet can use every core of the machine.
    per = -(-args.count // args.processes)
    children = [
        _spawn_fleet_part(args, base, start, min(per, args.count - start))
        for start in range(per, args.count, per)
    ]
    try:  # the event loop uvicorn would pick for a single server
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    try:
        with runner:
            runner.run(serve_many(fleet[:per], log_level="debug" if args.verbose else "warning"))
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=float(base.get("drain_timeout_s", 30)) + 10)
            except subprocess.TimeoutExpired:
                child.kill()
    return 0


#: the settings a fleet gives each worker itself (consecutive ports)
_FLEET_SKIP = ("port", "engine", "kv_events_endpoint", "kv_events_replay_endpoint")


def _replay_base_port(args: argparse.Namespace) -> int | None:
    """The first worker's replay port: as given, or by default the ports right after the
    event ports (a router started after the fleet asks a worker's replay socket what it
    already holds); 0 turns replay off."""
    if args.kv_events_replay_base_port is not None:
        if args.kv_events_replay_base_port and not args.kv_events_base_port:
            raise ValueError("--kv-events-replay-base-port needs --kv-events-base-port")
        return args.kv_events_replay_base_port or None
    if args.kv_events_base_port:
        return args.kv_events_base_port + args.count
    return None


def _spawn_fleet_part(
    args: argparse.Namespace, values: dict[str, Any], start: int, count: int
) -> subprocess.Popen[bytes]:
    """A child ``sim-fleet`` process for workers ``start .. start + count - 1``."""
    argv = [
        sys.executable,
        "-c",
        "import sys; from kvpool.cli import main; sys.exit(main())",
        "worker",
        "sim-fleet",
        "--count",
        str(count),
        "--base-port",
        str(args.base_port + start),
    ]
    if args.kv_events_base_port:
        argv += ["--kv-events-base-port", str(args.kv_events_base_port + start)]
        replay = _replay_base_port(args)
        argv += ["--kv-events-replay-base-port", str(replay + start if replay else 0)]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # never import the repository's operator/
    for name, value in values.items():
        if name == "pool_secret":  # a command line is visible to every user of the host
            env[f"{ENV_PREFIX}POOL_SECRET"] = str(value)
            env.pop(f"{ENV_PREFIX}POOL_SECRET_FILE", None)
            continue
        argv += ["--" + name.replace("_", "-"), str(value)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool worker", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a tiny random Llama model and tokenizer")
    p.add_argument("dir", help="directory to write (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--architecture", choices=sorted(ARCHITECTURES), default="llama")
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("fetch-model", help="download a model snapshot from the Hugging Face Hub")
    p.add_argument("--repo", required=True, help="the repository, e.g. Qwen/Qwen3-0.6B")
    p.add_argument("--revision", required=True, help="a branch, a tag or a commit sha")
    p.add_argument("--dir", required=True, help="where the snapshot appears (a symbolic link)")
    p.add_argument("--cache-dir", default=None, help="the Hugging Face cache (default: HF_HOME's)")
    p.add_argument("--include", action="append", default=[], help="only files matching (glob)")
    p.add_argument("--exclude", action="append", default=[], help="no files matching (glob)")
    p.set_defaults(func=_cmd_fetch_model)

    p = sub.add_parser("generate", help="generate text for prompts with a model directory")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    _settings_arguments(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("drain", help="drain the worker on this host (waits for its requests)")
    _admin_arguments(p)
    p.set_defaults(func=_cmd_drain)

    p = sub.add_parser("undrain", help="let a drained worker take requests again")
    _admin_arguments(p)
    p.set_defaults(func=_cmd_undrain)

    p = sub.add_parser("admin-token", help="print the admin token of the pool secret")
    _admin_arguments(p, target=False)
    p.set_defaults(func=_cmd_admin_token)

    p = sub.add_parser("sim-fleet", help="run N simulated workers in one process")
    p.add_argument("--count", type=int, required=True, help="how many workers")
    p.add_argument("--base-port", type=int, default=8100, help="HTTP port of the first")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="spread the workers over this many processes (one GIL each)",
    )
    p.add_argument(
        "--kv-events-base-port",
        type=int,
        default=None,
        help="ZMQ event port of the first (default: no events)",
    )
    p.add_argument(
        "--kv-events-replay-base-port",
        type=int,
        default=None,
        help="ZMQ replay port of the first (default: right after the event ports, "
        "--kv-events-base-port + --count; 0: no replay)",
    )
    _settings_arguments(p, skip=_FLEET_SKIP)
    p.set_defaults(func=_cmd_sim_fleet)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv, (ModelLoadError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
