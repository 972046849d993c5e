"""``kvpool operator ...``: the Kubernetes operator's commands.

* ``run``: reconcile InferencePools (kopf), in a pod with its service account or on a
  workstation with ``KUBECONFIG``;
* ``render FILE``: print the objects the operator would create for the pools in a
  manifest, without a cluster.

``run`` flags can also come from ``KVPOOL_OPERATOR_*`` variables (``--vllm-image`` from
``KVPOOL_OPERATOR_VLLM_IMAGE``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvpool.cli import run_command
from kvpool.settings_cli import add_settings_arguments

from .settings import ENV_PREFIX, OperatorSettings, load

log = logging.getLogger(__name__)


def _cmd_run(args: argparse.Namespace) -> int:
    import kopf

    from . import handlers
    from .peering import own_identity

    settings = load(args)
    handlers.SETTINGS = settings
    logging.getLogger().handlers.clear()  # kopf's handler replaces the generic one
    kopf.configure(verbose=args.verbose)
    # Our own id and priority, as kopf writes them in the peering object, are what the
    # operator's loop compares with the other replicas' (peering.is_active).
    handlers.IDENTITY = own_identity()
    priority = None
    if settings.peering is not None:
        priority = settings.peer_priority()
        log.info("peering %r as %s with priority %d (lifetime %ds)", settings.peering,
                 handlers.IDENTITY, priority, settings.peering_lifetime_s)  # fmt: skip
    kopf.run(
        clusterwide=not settings.namespace,
        namespaces=settings.namespace,
        standalone=settings.peering is None,
        peering_name=settings.peering,
        priority=priority,
        identity=handlers.IDENTITY,
        liveness_endpoint=(
            f"http://0.0.0.0:{settings.liveness_port}/healthz" if settings.liveness_port else None
        ),
    )
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    import yaml

    from kvpool.api.manifests import ManifestError, load_pools

    from .render import render

    settings = load(args, skip=("namespace",))
    try:
        pools = load_pools(args.file)
    except ManifestError as exc:
        raise ValueError(f"{args.file}: {exc}") from None
    docs = [
        child
        for name, spec in pools
        for child in render(name, args.namespace, spec, settings.images(), settings.peers())
    ]
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool operator", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="reconcile InferencePools in the cluster")
    add_settings_arguments(p, OperatorSettings, ENV_PREFIX)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("render", help="print the children of the pools in a manifest")
    p.add_argument("file", help="a YAML file with InferencePool objects")
    p.add_argument("--namespace", default="default", help="namespace of the children")
    add_settings_arguments(p, OperatorSettings, ENV_PREFIX, skip=("namespace",))
    p.set_defaults(func=_cmd_render)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv, (ValueError,))


if __name__ == "__main__":
    sys.exit(main())
