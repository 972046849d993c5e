"""The ``kvpool`` command line. Subcommands arrive with the components they drive.

* ``kvpool hash``: block keys of a token list, to check that a worker (ours or vLLM) and
  the router agree on block size and seed;
* ``kvpool events listen``: follow a worker's KV event stream as JSON lines;
* ``kvpool crd``: the InferencePool CustomResourceDefinition, generated from ``kvpool.api``;
* ``kvpool check``: validate InferencePool manifests as the operator will;
* ``kvpool up``: the local stack, a router and N workers on loopback (``--demo`` sends a
  few requests through it and stops);
* ``kvpool worker ...``: the inference worker's commands (``kvpool[worker]``);
* ``kvpool router ...``: the KV-aware router's commands (``kvpool[router]``);
* ``kvpool operator ...``: the Kubernetes operator's commands (``kvpool[operator]``).

A component's commands live in that component (``kvpool.worker.cli``): the core only
names the module and imports it when its command is run, so ``kvpool hash`` needs neither
torch nor a web framework.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
from collections.abc import Sequence

import msgspec

from . import __version__
from .hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED, BlockHasher, block_key


def parse_token_ids(text: str) -> list[int]:
    """Token ids written as ``1,2,3``, ``1 2 3`` or ranges such as ``1..64`` (inclusive)."""
    tokens: list[int] = []
    for part in text.replace(",", " ").split():
        try:
            if ".." in part:
                lo, hi = part.split("..", 1)
                start, stop = int(lo), int(hi)
                if stop < start:
                    raise ValueError
                tokens.extend(range(start, stop + 1))
            else:
                tokens.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a token id or an ascending range like 1..64"
            ) from None
    if any(t < 0 for t in tokens):
        raise argparse.ArgumentTypeError("token ids must not be negative")
    return tokens


def _cmd_hash(args: argparse.Namespace) -> int:
    hasher = BlockHasher(block_size=args.block_size, hash_seed=args.seed)
    digests = hasher.hash_prompt(args.tokens, lora_name=args.lora_name, cache_salt=args.cache_salt)
    print(f"# {hasher.fingerprint}: {len(args.tokens)} tokens, {len(digests)} full blocks")
    for i, digest in enumerate(digests):
        print(f"{i}\t{block_key(digest)}\t{digest.hex()}")
    return 0


async def _listen(args: argparse.Namespace) -> int:
    from .kv_events import EventSubscriber, Received

    seen = 0
    async with EventSubscriber(
        args.endpoint, args.replay, topic=args.topic, start_seq=args.from_seq
    ) as sub:
        async for item in sub:
            if isinstance(item, Received):
                line = {
                    "seq": item.seq,
                    "ts": item.batch.ts,
                    "data_parallel_rank": item.batch.data_parallel_rank,
                    "replayed": item.replayed,
                    "events": msgspec.to_builtins(item.batch.events),
                }
            else:
                line = {"resync_needed": msgspec.to_builtins(item)}
            print(json.dumps(line), flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    return 0


def _cmd_listen(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_listen(args))
    except KeyboardInterrupt:
        return 130


#: component commands: name -> (module with ``main(argv) -> int``, extra to install, help)
COMPONENTS = {
    "worker": ("kvpool.worker.cli", "worker", "the inference worker: serve, make-tiny-model"),
    "router": ("kvpool.router.cli", "router", "the KV-aware router: serve, route"),
    "operator": ("kvpool.operator.cli", "operator", "the Kubernetes operator: run, render"),
}


# What ``kvpool check`` checks as a real API server would (kvpool.operator.standins.CHECKS).
STAND_INS = ("cel-cost", "pod-validation", "pod-security-restricted", "server-side-apply")


def _cmd_crd(args: argparse.Namespace) -> int:
    from .api.crd import crd_yaml

    text = crd_yaml()
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"kvpool crd: wrote {args.output}", file=sys.stderr)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    """Each InferencePool validated as the operator validates it; then, unless skipped, what
    the API server would check of what the operator applies for it and of every other
    object in the files (a CRD, the chart's rendered manifests): the stand-ins of
    ``kvpool.operator.standins`` (the operator component, loaded as ``kvpool operator`` is)."""
    import importlib

    from .api import KIND as API_KIND
    from .api.manifests import ManifestError, is_pool, load_documents, load_pools

    checks = [c for c in STAND_INS if c not in set(args.skip or ())]
    standins = importlib.import_module("kvpool.operator.standins") if checks else None
    render = importlib.import_module("kvpool.operator.render").render if checks else None
    failed = 0
    for path in args.files:
        try:
            docs = load_documents(path)
            pools = load_pools(docs, allow_host_access=args.allow_host_access)
        except ManifestError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            failed += 1
            continue
        others = [d for d in docs if not is_pool(d) and d.get("kind")]
        if not pools and not others:
            print(f"{path}: no Kubernetes object in it", file=sys.stderr)
            failed += 1
        elif not pools and not checks:
            print(f"{path}: no {API_KIND} (kvpool.io) in it", file=sys.stderr)
            failed += 1
        namespace = "default"
        for name, spec in pools:
            findings = []
            if standins is not None and render is not None:
                findings = standins.check_objects(render(name, namespace, spec), checks)
            for finding in findings:
                print(f"{path}: InferencePool {name}: {finding}", file=sys.stderr)
            failed += bool(findings)
            if not findings:  # the engine and block size the operator gives it, where unset
                print(f"{path}: InferencePool {name}: valid (engine {spec.engine_type}, "
                      f"block size {spec.block_size})")  # fmt: skip
        if standins is not None and others:
            findings = standins.check_objects(others, checks)
            for finding in findings:
                print(f"{path}: {finding}", file=sys.stderr)
            failed += bool(findings)
            if not findings:
                print(f"{path}: {len(others)} other object(s) pass {', '.join(checks)}",
                      file=sys.stderr)  # fmt: skip
    if checks and not failed:  # (on stderr: stdout says what each pool is, as it did)
        print(f"checked as the API server would: {', '.join(checks)}", file=sys.stderr)
    return 1 if failed else 0


def _cmd_up(args: argparse.Namespace) -> int:
    import signal
    import subprocess
    from pathlib import Path

    from .stack import Stack, StackError, run_demo

    model = Path(args.model)
    keys = Path(args.api_keys_file) if args.api_keys_file else None
    if keys is not None and not keys.is_file():
        raise ValueError(f"--api-keys-file: {keys} is not a file")
    if keys is not None and args.demo:
        raise ValueError("--demo sends no API key: leave out --api-keys-file")
    if not (model / "config.json").is_file():
        if args.model != DEFAULT_STACK_MODEL:
            raise ValueError(f"--model: {model} is not a model directory (no config.json)")
        print(f"kvpool up: writing the tiny test model to {model}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())",
             "worker", "make-tiny-model", str(model)],
            check=True,
        )  # fmt: skip
    stack = Stack(
        model,
        workers=args.workers,
        engine=args.engine,
        port=args.port,
        policy=args.policy,
        verbose=args.verbose,
        api_keys_file=keys,
    )

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the stack as Ctrl-C does: in order

    signal.signal(signal.SIGTERM, terminate)
    try:
        stack.start()
        print(
            f"kvpool up: router on {stack.url} (OpenAI API at {stack.url}/v1), "
            f"{args.workers} {args.engine} worker(s): {' '.join(stack.worker_urls)}",
            flush=True,
        )
        if args.demo:
            run_demo(stack.url, model.resolve().name)
            return 0
        print("kvpool up: Ctrl-C stops the stack", flush=True)
        stack.wait()
    except KeyboardInterrupt:
        return 130
    except StackError as exc:
        print(f"kvpool up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
    return 0


DEFAULT_STACK_MODEL = ".cache/tiny-model"


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_command(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    errors: tuple[type[Exception], ...] = (ValueError,),
) -> int:
    """Parse, set up logging, run the chosen command; a bad setting or input (``errors``)
    ends it with one line and exit status 2, as argparse does for a bad flag."""
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        return args.func(args)
    except errors as exc:  # named precisely by the code that found them
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def _run_component(name: str, argv: list[str]) -> int:
    module_name, extra, _ = COMPONENTS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(
            f"kvpool: error: `kvpool {name}` needs kvpool[{extra}] installed ({exc})",
            file=sys.stderr,
        )
        return 2
    return module.main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hash", help="print the block keys of a token list")
    p.add_argument("tokens", type=parse_token_ids, help="token ids: '1,2,3', '1 2 3' or '1..64'")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--seed", default=DEFAULT_HASH_SEED, help="hash seed (vLLM: PYTHONHASHSEED)")
    p.add_argument("--lora-name", default=None)
    p.add_argument("--cache-salt", default=None)
    p.set_defaults(func=_cmd_hash)

    p = sub.add_parser("events", help="KV event streams")
    events = p.add_subparsers(dest="events_command", required=True)
    p = events.add_parser("listen", help="print a worker's KV events as JSON lines")
    p.add_argument("endpoint", help="the worker's PUB endpoint, e.g. tcp://10.0.0.5:5557")
    p.add_argument("--replay", default=None, help="the worker's replay endpoint, to fill gaps")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to")
    p.add_argument("--from-seq", type=int, default=None, help="replay from this sequence first")
    p.add_argument("--count", type=int, default=0, help="stop after this many lines (0: never)")
    p.set_defaults(func=_cmd_listen)

    p = sub.add_parser("crd", help="print (or write) the InferencePool CRD")
    p.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    p.set_defaults(func=_cmd_crd)

    p = sub.add_parser("check", help="validate InferencePool manifests (YAML) as the operator will")
    p.add_argument("files", nargs="+", help="YAML files (- for standard input)")
    p.add_argument("--allow-host-access", action="store_true", help="accept podTemplates that "
                   "ask for host access, as an operator with allowHostAccess does")  # fmt: skip
    p.add_argument("--skip", action="append", choices=STAND_INS, metavar="CHECK",
                   help="leave out one of the API server's checks: " + ", ".join(STAND_INS) +
                   " (pod-security-restricted: where a namespace does not enforce it)")  # fmt: skip
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("up", help="run a router and N workers on loopback (Ctrl-C stops them)")
    p.add_argument("--model", default=DEFAULT_STACK_MODEL, help="model directory (default: "
                   "the tiny test model, written there if missing)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", choices=("kvpool", "sim"), default="kvpool")
    p.add_argument("--port", type=int, default=8080, help="the router's port")
    p.add_argument("--policy", default="kvpool")
    p.add_argument("--demo", action="store_true", help="send the demo requests, then stop")
    p.add_argument("--api-keys-file", default=None, help="the router's tenants file: every "
                   "/v1 request then needs a key from it (default: no keys asked for)")  # fmt: skip
    p.set_defaults(func=_cmd_up)

    for name, (_, _, text) in COMPONENTS.items():
        # Listed for --help; `main` hands these commands to the component before parsing.
        sub.add_parser(name, help=f"{text} (kvpool {name} --help)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMPONENTS:
        return _run_component(argv[0], argv[1:])
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
