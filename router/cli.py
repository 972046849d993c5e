"""``kvpool router ...``: the KV-aware router's commands.

* ``serve --model DIR --worker URL ...``: the OpenAI-compatible gateway in front of the
  workers (``--discovery kubernetes`` finds them as pods instead);
* ``route --router URL [--chat] TEXT``: ask a running router where a prompt would go and
  why (its ``/debug/route``), without sending it.

Every ``serve`` flag can also come from a ``KVPOOL_ROUTER_*`` variable (``--policy`` from
``KVPOOL_ROUTER_POLICY``; ``--worker`` from ``KVPOOL_ROUTER_WORKER``, whitespace-separated);
a flag wins over the variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvpool.cli import run_command
from kvpool.settings_cli import add_settings_arguments, build_settings, settings_values

from .settings import ENV_PREFIX, RouterSettings


def _cmd_serve(args: argparse.Namespace) -> int:
    from .serving import serve

    settings = build_settings(RouterSettings, settings_values(args, RouterSettings, ENV_PREFIX))
    return serve(settings, log_level="debug" if args.verbose else "info")


def _cmd_route(args: argparse.Namespace) -> int:
    import httpx

    if args.chat:
        body = {"messages": [{"role": "user", "content": args.text}]}
    else:
        body = {"prompt": args.text}
    url = args.router.rstrip("/")
    try:
        resp = httpx.post(url + "/debug/route", json=body, timeout=10)
    except httpx.HTTPError as exc:
        print(f"kvpool router route: no answer from {url}: {exc or type(exc).__name__}",
              file=sys.stderr)  # fmt: skip
        return 1
    if resp.status_code != 200:
        print(resp.text, file=sys.stderr)
        return 1
    decision = resp.json()
    if args.json:
        print(json.dumps(decision, indent=2))
        return 0
    workers = _workers(url)
    print(
        f"-> {decision['worker']} ({decision['reason']}, policy {decision['policy']}): "
        f"{decision['num_tokens']} tokens, {decision['cached_tokens']} cached"
    )
    prefill = decision.get("prefill")
    if prefill:
        print(
            f"   split ({decision['pd_reason']}, {decision['uncached_tokens']} uncached): "
            f"prefill on {prefill['worker']} ({prefill['reason']}, "
            f"{prefill['cached_tokens']} cached), then decode on {decision['worker']}"
        )
    elif "pd_reason" in decision:
        print(f"   served whole ({decision['pd_reason']})")
    for c in decision["candidates"]:
        if c["filtered"]:
            print(f"   {c['worker']}: filtered by {c['filtered']}")
            continue
        scores = " ".join(f"{k}={v:.2f}" for k, v in c["scores"].items())
        ttft = c["predicted_ttft_s"]
        terms = c.get("ttft_terms") or {}
        # the cost model's terms: overhead + queue + waiting + prefill = predicted TTFT
        parts = " + ".join(
            f"{k.removesuffix('_s')} {v * 1000:.0f}" for k, v in terms.items() if v is not None
        )
        print(
            f"   {c['worker']}: cached {c['cached_tokens']}, queued {c['queued_tokens']}, "
            f"in flight {c['in_flight']}, predicted TTFT "
            f"{'-' if ttft is None else f'{ttft * 1000:.0f} ms'}"
            + (f" ({parts} ms)" if parts else "")
            + f", {scores}"
        )
        if note := _no_credit(workers.get(c["worker"])):
            print(f"      no cache credit: {note}")
    return 0


def _workers(url: str) -> dict[str, dict]:
    """The router's view of its workers (``/debug/workers``), by id; empty if it will not
    say (the route is printed all the same)."""
    import httpx

    try:
        rows = httpx.get(url + "/debug/workers", timeout=10).json()["workers"]
        return {w["id"]: w for w in rows}
    except Exception:
        return {}


def _no_credit(worker: dict | None) -> str | None:
    """Why the router gives a worker no cache credit, where it gives none: "cached" above
    is then what the index holds, not what the policy counts."""
    if worker is None or worker.get("cache_credit", True):
        return None
    if worker.get("mismatch"):
        return str(worker["mismatch"])
    check = worker.get("cache_check") or {}
    if check.get("flagged"):
        agreement = check.get("agreement")
        said = "" if agreement is None else f", agreement {agreement:.2f}"
        causes = check.get("likely_causes")
        return f"flagged {check.get('cause')}{said}" + (f": {causes}" if causes else "")
    return "the router gives it none"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool router", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the router")
    add_settings_arguments(p, RouterSettings, ENV_PREFIX)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("route", help="show where a running router would send a prompt")
    p.add_argument("text", help="the prompt (or, with --chat, one user message)")
    p.add_argument("--router", default="http://127.0.0.1:8080")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--json", action="store_true", help="print the whole decision as JSON")
    p.set_defaults(func=_cmd_route)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv)
