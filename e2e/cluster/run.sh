#!/usr/bin/env bash
# kvpool on a real cluster, end to end: the CRD (server-side apply, as an upgrade applies
# it), the operator (run here, against the cluster of the current kubeconfig context),
# examples/tiny-cpu.yaml in a namespace that enforces Pod Security "restricted", Ready, one
# chat completion through the router Service, then what only a real API server shows: a
# steady pool gets no write over two resyncs (no Deployment revision, no resourceVersion
# moves), one spec change is one Deployment revision, and status names the pool secret the
# operator made (it never reads Secrets). Exit 0: it worked; 77: no cluster to run on (a skip); anything else: a failure,
# after the operator's log, the pool and its pods are printed.
#
# Environment (all optional):
#   KVPOOL_E2E_NAMESPACE     namespace to create and delete (default kvpool-e2e)
#   KVPOOL_E2E_WORKER_IMAGE  the CPU worker image (else the one built, else the operator's)
#   KVPOOL_E2E_ROUTER_IMAGE  the router image (idem)
#   KVPOOL_E2E_BUILD=1       build both images with docker and load them into kind/minikube
#   KVPOOL_E2E_WORKER_DOCKERFILE, KVPOOL_E2E_ROUTER_DOCKERFILE   which Dockerfiles to build
#   KVPOOL_E2E_KIND_CLUSTER  the kind cluster to load images into (default: from the context)
#   KVPOOL_E2E_TIMEOUT_S     how long the pool may take to become Ready (default 600)
#   KVPOOL_E2E_KEEP=1        leave the namespace (and the pool in it) for a look afterwards
#   KVPOOL_E2E_LOG_DIR       where the operator and port-forward logs go (default: a temp dir)
#   KVPOOL_E2E_KVPOOL, KVPOOL_E2E_PYTHON   the kvpool command and a Python with `openai`
#   KVPOOL_E2E_QUIET_S       how long a steady pool is watched for writes (default 130:
#                            two of the operator's 60 s resyncs)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
# The repository root holds a folder named operator/: keep it off Python's path.
export PYTHONSAFEPATH=1

NS=${KVPOOL_E2E_NAMESPACE:-kvpool-e2e}
POOL=tiny
EXAMPLE=$ROOT/examples/tiny-cpu.yaml
CRD=$ROOT/crds/inferencepool.yaml
TIMEOUT_S=${KVPOOL_E2E_TIMEOUT_S:-600}
WORKER_IMAGE=${KVPOOL_E2E_WORKER_IMAGE:-}
ROUTER_IMAGE=${KVPOOL_E2E_ROUTER_IMAGE:-}
DECODE_REPLICAS=2  # as in the example

say() { printf '[e2e] %s\n' "$*"; }
err() { printf '[e2e] error: %s\n' "$*" >&2; }
skip() { printf '[e2e] skipped: %s\n' "$*" >&2; exit 77; }
fail() { err "$*"; exit 1; }
section() { printf '[e2e] ----- %s -----\n' "$*" >&2; }
# `timeout` where there is one (not on a stock macOS): a hung auth plugin must not hang us.
bounded() {
    local seconds=$1
    shift
    if command -v timeout >/dev/null 2>&1; then timeout "$seconds" "$@"; else "$@"; fi
}
kc() { kubectl --request-timeout=30s "$@"; }

pick() {  # the first of the given commands that exists
    local c
    for c in "$@"; do
        if [[ -x $c ]] || command -v "$c" >/dev/null 2>&1; then printf '%s' "$c"; return 0; fi
    done
    return 1
}

# --- is there a cluster? ---------------------------------------------------------------------

command -v kubectl >/dev/null 2>&1 || skip "kubectl is not on PATH"
if ! out=$(bounded 20 kubectl get --raw /version --request-timeout=5s 2>&1); then
    skip "no Kubernetes cluster reachable with the current kubeconfig" \
        "(KUBECONFIG=${KUBECONFIG:-unset}, context $(kubectl config current-context 2>/dev/null \
        || echo none)): ${out##*$'\n'}"
fi
CONTEXT=$(kubectl config current-context 2>/dev/null || echo in-cluster)
say "cluster: context $CONTEXT, server $(kubectl version -o json --request-timeout=5s 2>/dev/null \
    | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p' | tail -1)"

KVPOOL=${KVPOOL_E2E_KVPOOL:-$(pick "$ROOT/.venv/bin/kvpool" kvpool)} \
    || fail "no kvpool command: run 'make install' (or set KVPOOL_E2E_KVPOOL)"
PYTHON=${KVPOOL_E2E_PYTHON:-$(pick "$ROOT/.venv/bin/python" python3)} \
    || fail "no Python: run 'make install' (or set KVPOOL_E2E_PYTHON)"
"$PYTHON" -c 'import openai' 2>/dev/null \
    || fail "$PYTHON cannot import openai: run 'make install' (or set KVPOOL_E2E_PYTHON)"
# the pool, and what the operator renders for it, as the API server would check them
"$KVPOOL" check "$EXAMPLE" "$CRD" >/dev/null \
    || fail "$EXAMPLE or $CRD fails kvpool check (run it to see why)"

LOG_DIR=${KVPOOL_E2E_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvpool-e2e.XXXXXX")}
mkdir -p "$LOG_DIR"
OPERATOR_LOG=$LOG_DIR/operator.log
FORWARD_LOG=$LOG_DIR/port-forward.log
OPERATOR_PID=
FORWARD_PID=

# --- clean-up and diagnostics ----------------------------------------------------------------

stop() {  # stop one background process we started, by its pid: TERM, then KILL after 10 s
    local pid=$1
    [[ -n $pid ]] || return 0
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 20); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

diagnose() {
    section "the operator's log (last 60 lines of $OPERATOR_LOG)"
    tail -n 60 "$OPERATOR_LOG" >&2 2>/dev/null || true
    section "kubectl describe kvpool -n $NS"
    kc describe kvpool -n "$NS" >&2 2>&1 || true
    section "kubectl get pods -n $NS"
    kc get pods -n "$NS" -o wide >&2 2>&1 || true
    section "recent events in $NS"
    kc get events -n "$NS" --sort-by=.lastTimestamp 2>&1 | tail -n 25 >&2 || true
    section "pod logs (last 20 lines of each container)"
    kc logs -n "$NS" -l "kvpool.io/pool=$POOL" --all-containers --prefix --tail=20 \
        --max-log-requests=10 >&2 2>&1 || true
}

on_exit() {
    local rc=$?
    trap - EXIT
    trap '' PIPE  # a reader of our output that went away must not cut the clean-up short
    set +e
    stop "$FORWARD_PID"
    stop "$OPERATOR_PID"
    if [[ $rc -ne 0 && $rc -ne 77 ]]; then
        diagnose
    fi
    if [[ -n ${NS_CREATED:-}${NS_USED:-} && ${KVPOOL_E2E_KEEP:-0} == 1 ]]; then
        say "kept kvpool/$POOL in namespace $NS (KVPOOL_E2E_KEEP=1); the operator is stopped."
        say "Restart it with: $KVPOOL operator run --namespace $NS"
        say "Delete it with: kubectl delete" \
            "${NS_CREATED:+namespace $NS}${NS_USED:+kvpool $POOL -n $NS}"
    elif [[ -n ${NS_CREATED:-} ]]; then
        say "deleting namespace $NS"
        kc delete namespace "$NS" --wait=true --timeout=180s >/dev/null 2>&1 \
            || err "namespace $NS was not gone within 180 s (it goes on terminating)"
    elif [[ -n ${NS_USED:-} ]]; then
        say "deleting kvpool/$POOL from namespace $NS"
        kc delete kvpool "$POOL" -n "$NS" --ignore-not-found --wait=true --timeout=120s \
            >/dev/null 2>&1 || err "kvpool/$POOL was not deleted within 120 s"
    fi
    say "logs in $LOG_DIR"
    exit "$rc"
}
trap on_exit EXIT
# A signal ends the script through on_exit too (bash runs the EXIT trap for `exit` only).
trap 'exit 130' INT
trap 'exit 143' TERM

# --- images ----------------------------------------------------------------------------------

find_dockerfile() {  # $1: worker|router; the Dockerfile to build it from, if there is one
    local override=$2 f
    if [[ -n $override ]]; then printf '%s' "$override"; return 0; fi
    for f in "$1/Dockerfile.cpu" "$1/Dockerfile"; do
        if [[ $1 == router && $f == *.cpu ]]; then continue; fi
        if [[ -f $ROOT/$f ]]; then printf '%s' "$ROOT/$f"; return 0; fi
    done
    return 1
}

load_image() {  # make a locally built image visible to the cluster's nodes
    local image=$1 cluster
    if [[ $CONTEXT == kind-* ]] || [[ -n ${KVPOOL_E2E_KIND_CLUSTER:-} ]]; then
        cluster=${KVPOOL_E2E_KIND_CLUSTER:-${CONTEXT#kind-}}
        command -v kind >/dev/null 2>&1 || fail "kind is not on PATH: cannot load $image"
        say "loading $image into kind cluster $cluster"
        kind load docker-image "$image" --name "$cluster"
    elif [[ $CONTEXT == minikube ]] && command -v minikube >/dev/null 2>&1; then
        say "loading $image into minikube"
        minikube image load "$image"
    else
        say "context $CONTEXT is neither kind nor minikube: push $image to a registry the" \
            "nodes can pull from, or the pods will not start"
    fi
}

if [[ ${KVPOOL_E2E_BUILD:-0} == 1 ]]; then
    if ! command -v docker >/dev/null 2>&1; then
        say "KVPOOL_E2E_BUILD=1 but docker is not on PATH: not building images"
    else
        worker_df=$(find_dockerfile worker "${KVPOOL_E2E_WORKER_DOCKERFILE:-}") || worker_df=
        router_df=$(find_dockerfile router "${KVPOOL_E2E_ROUTER_DOCKERFILE:-}") || router_df=
        missing=
        if [[ -z $worker_df ]]; then missing+=" worker"; fi
        if [[ -z $router_df ]]; then missing+=" router"; fi
        if [[ -n $missing ]]; then
            say "KVPOOL_E2E_BUILD=1 but no Dockerfile for:$missing; not building images" \
                "(KVPOOL_E2E_WORKER_DOCKERFILE and KVPOOL_E2E_ROUTER_DOCKERFILE name them)"
        else
            WORKER_IMAGE=${WORKER_IMAGE:-kvpool-worker:e2e-cpu}
            ROUTER_IMAGE=${ROUTER_IMAGE:-kvpool-router:e2e}
            say "building $WORKER_IMAGE from $worker_df"
            docker build -f "$worker_df" -t "$WORKER_IMAGE" "$ROOT"
            say "building $ROUTER_IMAGE from $router_df"
            docker build -f "$router_df" -t "$ROUTER_IMAGE" "$ROOT"
            load_image "$WORKER_IMAGE"
            load_image "$ROUTER_IMAGE"
        fi
    fi
fi
# The operator puts these in the pods it renders; unset, it uses its own defaults.
if [[ -n $WORKER_IMAGE ]]; then export KVPOOL_OPERATOR_WORKER_CPU_IMAGE=$WORKER_IMAGE; fi
if [[ -n $ROUTER_IMAGE ]]; then export KVPOOL_OPERATOR_ROUTER_IMAGE=$ROUTER_IMAGE; fi
say "images: worker ${KVPOOL_OPERATOR_WORKER_CPU_IMAGE:-(operator default)}," \
    "router ${KVPOOL_OPERATOR_ROUTER_IMAGE:-(operator default)}"

# --- the namespace, the CRD, the operator ----------------------------------------------------

if [[ $(kc get namespace "$NS" -o 'jsonpath={.status.phase}' 2>/dev/null || true) == Terminating ]]
then
    say "namespace $NS is still terminating from an earlier run: waiting for it to go"
    kubectl wait --for=delete "namespace/$NS" --timeout=180s >/dev/null
fi
if kc get namespace "$NS" >/dev/null 2>&1; then
    # Not ours to delete: only the pool goes at the end (its children go with it).
    say "namespace $NS exists: using it"
    NS_USED=1
else
    say "creating namespace $NS, enforcing Pod Security \"restricted\""
    kc create namespace "$NS" >/dev/null
    NS_CREATED=1
    # kvpool's pods (vLLM's included) run restricted: a pod that did not is refused here,
    # and the pool's status says so (Degraded, ReplicaFailure)
    kc label namespace "$NS" pod-security.kubernetes.io/enforce=restricted \
        pod-security.kubernetes.io/enforce-version=latest >/dev/null
fi

# As the README's upgrade steps apply it (Helm never upgrades a chart's crds/): the API
# server checks its CEL rules' cost here, which the tests can only estimate.
say "applying $CRD (server-side)"
kc apply --server-side --force-conflicts --field-manager=kvpool-e2e -f "$CRD" >/dev/null
kubectl wait --for=condition=Established crd/inferencepools.kvpool.io --timeout=60s >/dev/null

say "starting the operator (log: $OPERATOR_LOG)"
"$KVPOOL" operator run --namespace "$NS" >"$OPERATOR_LOG" 2>&1 &
OPERATOR_PID=$!

# --- the pool --------------------------------------------------------------------------------

say "applying $EXAMPLE"
kc apply -n "$NS" -f "$EXAMPLE" >/dev/null

pod_problems() {  # waiting reasons that will not go away by themselves, one pod a line
    local fmt='{range .items[*]}{.metadata.name}{":"}'
    fmt+='{range .status.initContainerStatuses[*]}{" "}{.state.waiting.reason}{end}'
    fmt+='{range .status.containerStatuses[*]}{" "}{.state.waiting.reason}{end}{"\n"}{end}'
    kc get pods -n "$NS" -l "kvpool.io/pool=$POOL" -o "jsonpath=$fmt" 2>/dev/null \
        | grep -E 'ImagePullBackOff|InvalidImageName|ErrImageNeverPull' | tr '\n' ' ' || true
}

say "waiting up to ${TIMEOUT_S}s for kvpool/$POOL to be Ready"
deadline=$((SECONDS + TIMEOUT_S))
last=
until kubectl wait --for=condition=Ready "kvpool/$POOL" -n "$NS" --timeout=10s >/dev/null 2>&1
do
    kill -0 "$OPERATOR_PID" 2>/dev/null || fail "the operator exited"
    problems=$(pod_problems)
    if [[ -n $problems ]]; then
        fail "pods cannot start: $problems (give KVPOOL_E2E_WORKER_IMAGE and" \
            "KVPOOL_E2E_ROUTER_IMAGE, or KVPOOL_E2E_BUILD=1 with docker)"
    fi
    now=$(kc get kvpool "$POOL" -n "$NS" --no-headers 2>/dev/null || true)
    if [[ -n $now && $now != "$last" ]]; then say "  $now"; last=$now; fi
    ((SECONDS < deadline)) || fail "kvpool/$POOL was not Ready within ${TIMEOUT_S}s"
    sleep 2  # kubectl wait returns at once when it cannot watch yet (the CRD just arrived)
done
say "kvpool/$POOL is Ready"
kc get kvpool -n "$NS"
kc get pods -n "$NS" -o wide

# --- one request through the router ----------------------------------------------------------

say "port-forwarding svc/$POOL-router (log: $FORWARD_LOG)"
kubectl port-forward -n "$NS" --address 127.0.0.1 "svc/$POOL-router" :80 >"$FORWARD_LOG" 2>&1 &
FORWARD_PID=$!
port=
for _ in $(seq 60); do
    port=$(sed -n 's/^Forwarding from 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$FORWARD_LOG" | head -1)
    [[ -n $port ]] && break
    kill -0 "$FORWARD_PID" 2>/dev/null || fail "kubectl port-forward exited: $(cat "$FORWARD_LOG")"
    sleep 0.5
done
[[ -n $port ]] || fail "kubectl port-forward did not start within 30 s"
say "router at http://127.0.0.1:$port (OpenAI API under /v1)"

"$PYTHON" - "http://127.0.0.1:$port" "$DECODE_REPLICAS" <<'EOF'
"""One chat completion through the router, once it sees every worker."""

import json
import sys
import time
import urllib.request

import openai

base, workers = sys.argv[1], int(sys.argv[2])

# The pool is Ready when its pods are; the router learns of them through its own watch.
deadline = time.monotonic() + 60
health: dict = {}
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            health = json.load(r)
    except Exception as exc:  # 503 while it has no worker, or the forward not yet up
        health = {"error": str(exc)}
    if health.get("workers_up", 0) >= workers:
        break
    time.sleep(1)
print(f"[e2e] router /health: {json.dumps(health)}")
if health.get("workers_up", 0) < workers:
    sys.exit(f"[e2e] error: the router sees {health.get('workers_up', 0)} of {workers} workers")

client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
deadline = time.monotonic() + 60
while True:
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello from the cluster end-to-end test."}],
            max_tokens=8,
        )
        break
    except (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError) as exc:
        if time.monotonic() > deadline:
            raise
        print(f"[e2e] retrying: {exc}")
        time.sleep(2)
reply = raw.parse()
choice = reply.choices[0]
print(f"[e2e] answer from {raw.headers.get('x-kvpool-worker')}: {choice.message.content!r}")
print(
    f"[e2e] model {reply.model}, finish_reason {choice.finish_reason},"
    f" {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens"
)
if reply.model != "tiny" or not reply.usage.completion_tokens:
    sys.exit("[e2e] error: the answer is not from the tiny model, or has no tokens")
EOF

# --- what only a real API server shows -------------------------------------------------------

revisions() {  # kind/name generation resourceVersion, of every child of the pool
    kc get deployments,services,configmaps,serviceaccounts,roles,rolebindings,\
poddisruptionbudgets,networkpolicies -n "$NS" -l "kvpool.io/pool=$POOL" \
        -o 'jsonpath={range .items[*]}{.kind}/{.metadata.name} {.metadata.generation} {.metadata.resourceVersion}{"\n"}{end}' \
        | grep -v '^Deployment/.* ' || true
    # Deployments: their status moves with every probe; their generation is the template's
    kc get deployments -n "$NS" -l "kvpool.io/pool=$POOL" \
        -o 'jsonpath={range .items[*]}{.kind}/{.metadata.name} {.metadata.generation}{"\n"}{end}'
}

QUIET_S=${KVPOOL_E2E_QUIET_S:-130}
say "watching the steady pool for ${QUIET_S}s: the operator's resyncs must write nothing"
before=$(revisions)
sleep "$QUIET_S"
after=$(revisions)
if [[ $before != "$after" ]]; then
    diff <(printf '%s\n' "$before") <(printf '%s\n' "$after") >&2 || true
    fail "the operator wrote to a steady pool's children (a webhook's change written over?)"
fi

decode_generation() {
    kc get deployment "$POOL-decode" -n "$NS" -o 'jsonpath={.metadata.generation}'
}
change_spec() {  # $1: what it is, $2: the merge patch; the decode Deployment's revisions
    local before now
    before=$(decode_generation)
    say "changing the spec: $1"
    kc patch kvpool "$POOL" -n "$NS" --type=merge -p "$2" >/dev/null
    for _ in $(seq 60); do
        now=$(decode_generation)
        ((now > before)) && break
        sleep 1
    done
    sleep 10  # and any second write would have come by now
    now=$(decode_generation)
    ((now == before + 1)) || fail "one spec change ($1) made $((now - before)) revisions"
}
# A field dropped and another changed at once: an operator that first patched the dropped
# field away and then applied made two revisions (a wasted surge pod on a GPU).
change_spec "a node selector every Linux node matches" \
    '{"spec":{"decode":{"nodeSelector":{"kubernetes.io/os":"linux"}}}}'
change_spec "the node selector dropped, an env var added, in one change" \
    '{"spec":{"decode":{"nodeSelector":null,"env":[{"name":"KVPOOL_E2E","value":"1"}]}}}'

secret=$(kc get kvpool "$POOL" -n "$NS" -o 'jsonpath={.status.poolSecret.name}')
[[ $secret == "$POOL-pool-secret" ]] || fail "status.poolSecret does not name the pool secret"

say "passed"
