"""``kvpool operator ...``: the Kubernetes operator's commands.

* ``run``: reconcile InferencePools (kopf), in a pod with its service account or on a
  workstation with ``KUBECONFIG``; with ``--lease-name``, only while this replica holds
  that Lease (leader election: it waits for it first, and exits 1 when it loses it);
* ``render FILE``: print the objects the operator would create for the pools in a
  manifest, without a cluster.

``run`` flags can also come from ``KVPOOL_OPERATOR_*`` variables (``--vllm-image`` from
``KVPOOL_OPERATOR_VLLM_IMAGE``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.cli import run_command
from kvpool.settings_cli import add_settings_arguments

from .settings import ENV_PREFIX, OperatorSettings, load

if TYPE_CHECKING:
    from .leader import LeaderElector, Leadership

log = logging.getLogger(__name__)


def _cmd_run(args: argparse.Namespace) -> int:
    import kopf

    from . import handlers

    settings = load(args)
    handlers.SETTINGS = settings
    logging.getLogger().handlers.clear()  # kopf's handler replaces the generic one
    kopf.configure(verbose=args.verbose)
    leadership = None
    if settings.lease() is not None:
        leadership = _wait_to_lead(settings)
        if leadership is None:  # stopped (SIGTERM) while waiting
            return 0
        handlers.LEADER = leadership.elector
    try:
        # kopf runs standalone: which replica acts is the Lease's business, not kopf peering's.
        kopf.run(
            clusterwide=not settings.namespace,
            namespaces=settings.namespace,
            standalone=True,
            liveness_endpoint=(
                f"http://0.0.0.0:{settings.liveness_port}/healthz"
                if settings.liveness_port
                else None
            ),
        )
    finally:
        if leadership is not None:  # after kopf's cleanup: nothing acts any more
            leadership.stop(release=True)
    return 0


def _wait_to_lead(settings: OperatorSettings) -> Leadership | None:
    """Wait until this replica holds the Lease, then keep renewing it in a thread; None when
    stopped while waiting. Meanwhile ``/healthz`` and ``/metrics`` answer (a waiting replica
    is alive, and not active), on the ports kopf and the handlers take over afterwards."""
    from . import metrics
    from .leader import Leadership

    elector = leader_elector(settings)
    leadership = Leadership(elector, on_lost=_exit_lost)
    log.info("leader election: Lease %s/%s as %s (lease %gs, renew deadline %gs, retry %gs)",
             *settings.lease() or ("", ""), elector.identity, settings.lease_duration_s,
             settings.renew_deadline_s, settings.retry_period_s)  # fmt: skip
    servers = []
    if settings.liveness_port:
        servers.append(_serve_health(settings.liveness_port))
    if settings.metrics_port is not None:
        idle = metrics.make_registry(lambda: metrics.OperatorView(active=False))
        servers.append(metrics.serve(idle, settings.metrics_port))

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d while waiting for the Lease: stopping", signum)
        leadership.stop(release=False)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        led = leadership.acquire()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for server in servers:  # kopf and the handlers bind these ports next
            server.shutdown()
            server.server_close()
    if not led or leadership.stopping:  # a signal as the Lease was taken: give it back
        leadership.stop(release=True)
        return None
    leadership.start_renewing()
    return leadership


def leader_elector(settings: OperatorSettings) -> LeaderElector:
    """This replica's elector for the settings' Lease, over the API server of this run."""
    from .cluster import api_client
    from .leader import KubernetesLeaseAPI, LeaderElector, own_identity

    lease = settings.lease()
    if lease is None:
        raise ValueError("leader election needs lease_name (and lease_namespace)")
    namespace, name = lease
    return LeaderElector(
        KubernetesLeaseAPI(api_client(), namespace, name),
        own_identity(),
        lease_duration_s=settings.lease_duration_s,
        renew_deadline_s=settings.renew_deadline_s,
        retry_period_s=settings.retry_period_s,
    )


def _exit_lost() -> None:
    """Leadership lost: stop at once, as controller-runtime does (the pod restarts and
    becomes a candidate). Another replica may take over as soon as the lease expires, so
    there is no graceful shutdown to wait for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)


def _serve_health(port: int) -> Any:
    """``/healthz`` while waiting for the Lease (kopf serves it once it runs)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if self.path.split("?")[0] == "/healthz" else 404
            body = b"waiting for the Lease\n" if status == 200 else b""
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # the kubelet probes every period
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Health)
    threading.Thread(target=server.serve_forever, name="kvpool-health", daemon=True).start()
    return server


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
