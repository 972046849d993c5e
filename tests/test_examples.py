"""The example pools in ``examples/``: each validates as the operator will, passes
``kvpool check``, and renders into what its comments and ``examples/README.md`` promise.

Every example file has a checker in ``CLAIMS`` (a new file without one fails
``test_every_example_has_its_claims_checked``) and a section in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvpool.api import validate_pool
from kvpool.api.inferencepool import InferencePoolSpec
from kvpool.api.manifests import load_pools
from kvpool.operator.render import (
    GROUP_LABEL,
    HF_SNAPSHOT,
    MODEL_MOUNT,
    ROLE_LABEL,
    Images,
    Manifest,
    render,
)
from kvpool.settings_cli import build_settings, settings_values

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FILES = sorted(p.name for p in EXAMPLES.glob("*.y*ml"))
NS = "default"
IMAGES = Images()  # the operator's defaults, which the examples and their README name
KUBERNETES = "1.31.0"  # the oldest Kubernetes the examples' objects are checked against


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d is not None]


def rendered(name: str) -> dict[str, tuple[InferencePoolSpec, list[Manifest]]]:
    """Every pool in the file, by name: its spec and the children the operator applies."""
    return {pool: (spec, render(pool, NS, spec)) for pool, spec in load_pools(EXAMPLES / name)}


def the_pool(name: str) -> tuple[str, InferencePoolSpec, list[Manifest]]:
    pools = rendered(name)
    assert len(pools) == 1, f"{name}: one pool expected, found {sorted(pools)}"
    [(pool, (spec, children))] = pools.items()
    return pool, spec, children


def find(children: list[Manifest], kind: str, name: str) -> Manifest:
    found = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind} {name} among the children"
    return found[0]


def workers(children: list[Manifest]) -> dict[str, Manifest]:
    """The worker Deployments, by role (their kvpool.io/group label)."""
    return {
        c["metadata"]["labels"][GROUP_LABEL]: c
        for c in children
        if c["kind"] == "Deployment" and GROUP_LABEL in c["metadata"]["labels"]
    }


def router_deployment(children: list[Manifest]) -> Manifest:
    [found] = [c for c in children if c["kind"] == "Deployment" and is_router(c)]
    return found


def router_config_map(children: list[Manifest]) -> Manifest:
    [found] = [c for c in children if c["kind"] == "ConfigMap" and is_router(c)]
    return found


def pod_labels(deployment: Manifest) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def is_router(obj: Manifest) -> bool:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"] == "router"


def container(deployment: Manifest, name: str) -> Manifest:
    pod = deployment["spec"]["template"]["spec"]
    [found] = [c for c in pod["containers"] if c["name"] == name]
    return found


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in an argument list (which must hold it once)."""
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def env_of(c: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def assert_gpu_workers(children: list[Manifest], image: str) -> None:
    """One nvidia.com/gpu per worker container, requested and limited, in the given image."""
    for role, deployment in workers(children).items():
        c = container(deployment, "worker")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", role
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1", role
        assert c["image"] == image, role
        gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        assert gpu_taint in deployment["spec"]["template"]["spec"]["tolerations"], role


def assert_model_on_claim(children: list[Manifest], spec: InferencePoolSpec) -> None:
    """Every worker and router pod mounts the claim read-only and reads the model from it."""
    pvc = spec.model.source.pvc
    assert pvc is not None
    model_dir = f"{MODEL_MOUNT}/{pvc.path}"
    pods = {**workers(children), "router": router_deployment(children)}
    for role, deployment in pods.items():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": pvc.claim_name,
            "readOnly": True,
        }, role
        c = pod["containers"][0]
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        assert mount in c["volumeMounts"], role
        if role == "router":
            assert router_config_map(children)["data"]["KVPOOL_ROUTER_MODEL"] == model_dir
        elif spec.engine_type == "vllm":
            assert c["args"][0] == model_dir, role
        else:
            assert flag(c["args"], "--model") == model_dir, role


def assert_vllm_prefix_caching_and_events(
    children: list[Manifest], spec: InferencePoolSpec
) -> None:
    """The operator's additions to vLLM's command line that the router depends on."""
    for role, deployment in workers(children).items():
        c = container(deployment, "worker")
        assert c["image"] == IMAGES.vllm, role
        assert c["command"] == ["vllm", "serve"], role
        args = c["args"]
        assert args.count("--enable-prefix-caching") == 1, role  # added once, by the operator
        assert flag(args, "--prefix-caching-hash-algo") == "sha256_cbor", role
        assert flag(args, "--block-size") == str(spec.block_size), role
        events = json.loads(flag(args, "--kv-events-config"))
        assert events["enable_kv_cache_events"] is True
        assert events["publisher"] == "zmq"
        assert events["endpoint"] == f"tcp://*:{spec.engine.kv_events.port}"
        assert env_of(c)["PYTHONHASHSEED"] == spec.engine.hash_seed, role
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["kv-events"] == spec.engine.kv_events.port
    config = router_config_map(children)["data"]
    assert config["KVPOOL_ROUTER_WORKER_EVENTS_PORT"] == str(spec.engine.kv_events.port)
    assert config["KVPOOL_ROUTER_HASH_SEED"] == spec.engine.hash_seed


# --- what each example claims ---------------------------------------------------------------


def claims_tiny_cpu(pool: str, spec: InferencePoolSpec, children: list[Manifest]) -> None:
    """Two kvpool workers on CPU serving whole requests, the built-in model made in the pod."""
    assert spec.disaggregation.mode == "Aggregated"
    assert set(workers(children)) == {"decode"}
    decode = workers(children)["decode"]
    assert decode["spec"]["replicas"] == 2
    c = container(decode, "worker")
    assert c["image"] == IMAGES.worker_cpu
    assert not any("nvidia.com" in k for part in c["resources"].values() for k in part)
    init = decode["spec"]["template"]["spec"]["initContainers"]
    assert [i["command"] for i in init] == [["kvpool", "worker", "make-tiny-model"]]
    assert pod_labels(decode)[ROLE_LABEL] == "both"


def claims_gpu_kvpool_pvc(pool: str, spec: InferencePoolSpec, children: list[Manifest]) -> None:
    """kvpool workers on one GPU each (the CUDA image), the model from the claim, Auto mode,
    both roles autoscaled to the SLO (Active)."""
    assert spec.engine.type == "kvpool"  # named: a GPU pool that names no engine runs vLLM
    assert spec.disaggregation.mode == "Auto"
    assert set(workers(children)) == {"prefill", "decode"}
    assert_gpu_workers(children, IMAGES.worker)
    assert_model_on_claim(children, spec)
    labels = {r: pod_labels(d)[ROLE_LABEL] for r, d in workers(children).items()}
    assert labels == {"prefill": "prefill", "decode": "both"}  # Auto: decode serves short ones
    assert spec.slo is not None and spec.autoscaling.mode == "Active"
    for role, deployment in workers(children).items():
        assert spec.autoscaled(role), role
        bounds = getattr(spec.autoscaling, role)
        assert bounds.min_replicas <= deployment["spec"]["replicas"] <= bounds.max_replicas
        args = container(deployment, "worker")["args"]
        assert flag(args, "--kv-events-endpoint") == f"tcp://*:{spec.engine.kv_events.port}"
        assert "--kv-pin-timeout-s" in args  # prefill workers hold blocks for decode ones


def claims_vllm_aggregated(pool: str, spec: InferencePoolSpec, children: list[Manifest]) -> None:
    """vLLM workers (the default image) with prefix caching and KV events, whole requests,
    the autoscaler advising only."""
    assert spec.engine_type == "vllm" and spec.engine.image is None
    assert set(workers(children)) == {"decode"}
    assert_gpu_workers(children, IMAGES.vllm)
    assert_model_on_claim(children, spec)
    assert_vllm_prefix_caching_and_events(children, spec)
    decode = container(workers(children)["decode"], "worker")
    assert "--kv-transfer-config" not in decode["args"]
    assert spec.autoscaling.enabled and spec.autoscaling.mode == "Advisory"
    assert not spec.autoscaled("decode")  # advice only: the spec's replicas stand


def claims_vllm_disaggregated(pool: str, spec: InferencePoolSpec, children: list[Manifest]) -> None:
    """vLLM prefill and decode workers on GPUs, KV blocks moved by the NixlConnector."""
    assert spec.engine_type == "vllm"
    assert spec.disaggregation.mode == "Disaggregated"
    assert set(workers(children)) == {"prefill", "decode"}
    assert_gpu_workers(children, IMAGES.vllm)
    assert_model_on_claim(children, spec)
    assert_vllm_prefix_caching_and_events(children, spec)
    port = spec.engine.kv_transfer.side_channel_port
    for role, deployment in workers(children).items():
        assert (
            pod_labels(deployment)[ROLE_LABEL] == role
        )  # Disaggregated: decode workers only decode
        c = container(deployment, "worker")
        transfer = json.loads(flag(c["args"], "--kv-transfer-config"))
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}, role
        env = env_of(c)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
        assert {"name": "nixl", "containerPort": port, "protocol": "TCP"} in c["ports"]


def claims_vllm_huggingface(pool: str, spec: InferencePoolSpec, children: list[Manifest]) -> None:
    """vLLM workers whose init containers download the repository at its revision into the
    claim the file makes, with the token from the Secret; vLLM serves the snapshot offline;
    the router downloads the tokenizer."""
    hf = spec.model.source.huggingface
    assert hf is not None and hf.token_secret_ref is not None and hf.cache_claim_name
    assert set(workers(children)) == {"decode"}
    assert_gpu_workers(children, IMAGES.vllm)
    assert_vllm_prefix_caching_and_events(children, spec)
    claims = {d["metadata"]["name"]: d for d in documents("vllm-huggingface.yaml")}
    assert "ReadWriteMany" in claims[hf.cache_claim_name]["spec"]["accessModes"]
    token = {"secretKeyRef": {"name": hf.token_secret_ref.name, "key": "token"}}
    for role, deployment in workers(children).items():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["hf-cache"]["persistentVolumeClaim"]["claimName"] == hf.cache_claim_name
        [init] = pod["initContainers"]
        assert init["image"] == IMAGES.vllm and hf.revision in init["args"], role
        assert env_of(init)["HF_TOKEN"] == token, role
        c = container(deployment, "worker")
        assert c["args"][0] == HF_SNAPSHOT and env_of(c)["HF_HUB_OFFLINE"] == "1", role
        assert "HF_TOKEN" not in env_of(c), role
    router_pod = router_deployment(children)["spec"]["template"]["spec"]
    [init] = router_pod["initContainers"]
    assert init["command"] == ["kvpool", "worker", "fetch-model"] and "--include" in init["args"]
    assert router_config_map(children)["data"]["KVPOOL_ROUTER_MODEL"] == HF_SNAPSHOT


CLAIMS: dict[str, Callable[[str, InferencePoolSpec, list[Manifest]], None]] = {
    "tiny-cpu.yaml": claims_tiny_cpu,
    "gpu-kvpool-pvc.yaml": claims_gpu_kvpool_pvc,
    "vllm-aggregated.yaml": claims_vllm_aggregated,
    "vllm-disaggregated.yaml": claims_vllm_disaggregated,
    "vllm-huggingface.yaml": claims_vllm_huggingface,
}


# --- the tests ------------------------------------------------------------------------------


def test_every_example_has_its_claims_checked() -> None:
    assert FILES, "no examples found"
    assert set(FILES) == set(CLAIMS), "add a checker to CLAIMS for each example (and only them)"


def test_every_example_is_documented_in_the_readme() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    sections = re.findall(r"^## `([^`]+)`$", readme, flags=re.MULTILINE)
    assert sorted(sections) == FILES, "examples/README.md needs one section per example file"
    for name in FILES:  # and the commands to apply it
        assert f"kubectl apply -f examples/{name}" in readme, name


@pytest.mark.parametrize("name", FILES)
def test_example_validates_as_the_operator_will(name: str) -> None:
    pools = [d for d in documents(name) if d.get("kind") == "InferencePool"]
    assert pools, f"{name} holds no InferencePool"
    for doc in pools:
        assert doc["apiVersion"] == "kvpool.io/v1alpha1"
        validate_pool(doc["metadata"]["name"], doc["spec"])  # raises naming every problem
    assert [n for n, _ in load_pools(EXAMPLES / name)] == [d["metadata"]["name"] for d in pools]


def test_kvpool_check_passes_on_every_example() -> None:
    exe = shutil.which("kvpool", path=str(Path(sys.executable).parent)) or "kvpool"
    paths = [str(EXAMPLES / n) for n in FILES]
    out = subprocess.run(
        [exe, "check", *paths],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for name in FILES:
        for pool in rendered(name):
            assert f"{EXAMPLES / name}: InferencePool {pool}: valid" in out.stdout


@pytest.mark.parametrize("name", FILES)
def test_example_renders_what_it_claims(name: str) -> None:
    pool, spec, children = the_pool(name)
    CLAIMS[name](pool, spec, children)


@pytest.mark.parametrize("name", FILES)
def test_example_objects_are_valid_kubernetes(name: str) -> None:
    """The other objects in the file, and every child the operator makes of its pools,
    against the Kubernetes schemas (strict: an unknown field fails)."""
    objects = [d for d in documents(name) if d.get("kind") != "InferencePool"]
    for _, children in rendered(name).values():
        objects += children
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("name", FILES)
def test_kvpool_workers_take_the_rendered_arguments(name: str, tmp_path: Path) -> None:
    """``kvpool worker serve`` parses the command line the operator gives it (the example's
    engine.args included) into valid settings."""
    from kvpool.worker.cli import ENV_PREFIX, build_parser
    from kvpool.worker.settings import WorkerSettings

    (tmp_path / "config.json").write_text("{}")  # stands in for the model directory
    _, spec, children = the_pool(name)
    if spec.engine_type != "kvpool":
        pytest.skip("vLLM workers: vLLM parses its own arguments")
    for role, deployment in workers(children).items():
        c = container(deployment, "worker")
        assert c["command"] == ["kvpool", "worker", "serve"]
        args = build_parser().parse_args(["serve", *c["args"]])
        values = settings_values(args, WorkerSettings, ENV_PREFIX)
        settings = build_settings(WorkerSettings, {**values, "model": str(tmp_path)})
        assert settings.port == spec.engine.port, role
        assert settings.block_size == spec.block_size, role


@pytest.mark.parametrize("name", FILES)
def test_router_takes_the_rendered_config(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's ConfigMap (KVPOOL_ROUTER_*) builds valid router settings."""
    from kvpool.router.settings import ENV_PREFIX, RouterSettings

    (tmp_path / "config.json").write_text("{}")
    pool, spec, children = the_pool(name)
    data = router_config_map(children)["data"]
    assert data == find(children, "ConfigMap", f"{pool}-router")["data"]
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in {**data, "KVPOOL_ROUTER_MODEL": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    values = settings_values(argparse.Namespace(), RouterSettings, ENV_PREFIX)
    settings = build_settings(RouterSettings, values)
    assert settings.discovery == "kubernetes"
    assert settings.block_size == spec.block_size
    assert settings.served_model_name == spec.model.name


# --- the claim and the download Job ---------------------------------------------------------


def _all_documents() -> list[dict[str, Any]]:
    return [d for name in FILES for d in documents(name)]


def test_every_claim_a_pool_reads_is_made_and_filled_by_an_example() -> None:
    """A pool's pvc source names a claim some example makes (mountable on many nodes), and a
    Job in the examples downloads the model into the directory the pool reads."""
    docs = _all_documents()
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    downloads = set()  # (claim, directory inside it) that a Job writes
    for job in (d for d in docs if d["kind"] == "Job"):
        pod = job["spec"]["template"]["spec"]
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        for c in pod["containers"]:
            local_dir = flag(c["command"], "--local-dir")
            for mount in c["volumeMounts"]:
                prefix = mount["mountPath"].rstrip("/") + "/"
                if local_dir.startswith(prefix):
                    downloads.add((volumes[mount["name"]], local_dir.removeprefix(prefix)))
    readers = [
        (name, spec.model.source.pvc)
        for name in FILES
        for _, (spec, _) in rendered(name).items()
        if spec.model.source.pvc is not None
    ]
    assert readers, "no example reads a claim"
    for name, pvc in readers:
        assert pvc.claim_name in claims, f"{name}: no example makes claim {pvc.claim_name}"
        modes = set(claims[pvc.claim_name]["spec"]["accessModes"])
        assert modes & {"ReadWriteMany", "ReadOnlyMany"}, "workers on many nodes mount it"
        assert (pvc.claim_name, pvc.path) in downloads, f"{name}: nothing downloads {pvc.path}"


def test_download_job_runs_as_the_image_user_with_a_command_it_has() -> None:
    """The Job's image is the operator's CPU worker image, it runs as that image's user (so
    the workers can read what it writes), and the `hf` command in it takes its flags."""
    worker_user = re.findall(
        r"^USER\s+(\d+):(\d+)\s*$", (ROOT / "worker" / "Dockerfile.cpu").read_text(), re.M
    )[-1]
    jobs = [d for d in _all_documents() if d["kind"] == "Job"]
    assert jobs
    hf = Path(sys.executable).with_name("hf")
    assert hf.exists(), "the Hugging Face CLI comes with huggingface_hub (kvpool[worker])"
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        security = pod["securityContext"]
        assert (str(security["runAsUser"]), str(security["runAsGroup"])) == worker_user
        assert str(security["fsGroup"]) == worker_user[1]
        for c in pod["containers"]:
            assert c["image"] == IMAGES.worker_cpu
            assert c["command"][:2] == ["hf", "download"]
            help_text = subprocess.run(
                [str(hf), "download", "--help"],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"},
                timeout=120,
            ).stdout
            for arg in c["command"][2:]:
                if arg.startswith("--"):
                    assert arg in help_text, f"`hf download` has no {arg}"


# --- tenants/: API keys and a locked-down pool ------------------------------------------------

TENANTS = EXAMPLES / "tenants"


def tenants_documents() -> dict[str, dict[str, Any]]:
    """The objects of examples/tenants/, by kind."""
    docs = [
        d
        for path in sorted(TENANTS.glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d is not None
    ]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) == 2, "one pool and one Secret"
    return by_kind


def test_the_tenants_pool_renders_what_its_readme_says() -> None:
    from kvpool.operator.render import TENANTS_MOUNT

    docs = tenants_documents()
    secret = docs["Secret"]
    [(pool, spec)] = load_pools(TENANTS / "pool.yaml")
    children = render(pool, NS, spec)
    assert spec.router.auth is not None
    assert spec.router.auth.secret_name == secret["metadata"]["name"]
    assert spec.router.auth.key in secret["stringData"]
    router = router_deployment(children)
    pod = router["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [
        m for m in container(router, "router")["volumeMounts"] if m["mountPath"] == TENANTS_MOUNT
    ]
    assert mount["readOnly"] is True and "subPath" not in mount
    assert volumes[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    config = router_config_map(children)["data"]
    assert config["KVPOOL_ROUTER_API_KEYS_FILE"] == f"{TENANTS_MOUNT}/{spec.router.auth.key}"
    assert config["KVPOOL_ROUTER_SATURATION_TTFT_S"] == "2"
    # the pool secret: made once by the operator, read by the router and the workers
    made = find(children, "Secret", f"{pool}-pool-secret")
    ref = {"secretKeyRef": {"name": made["metadata"]["name"], "key": "pool-secret"}}
    assert env_of(container(router, "router"))["KVPOOL_ROUTER_POOL_SECRET"] == ref
    assert set(workers(children)) == {"prefill", "decode"}
    for role, deployment in workers(children).items():
        assert env_of(container(deployment, "worker"))["KVPOOL_POOL_SECRET"] == ref, role
    # the policies, and the scrapers the pool names instead of the default
    policies = {c["metadata"]["name"]: c for c in children if c["kind"] == "NetworkPolicy"}
    assert set(policies) == {f"{pool}-workers", f"{pool}-router"}
    http_rule = policies[f"{pool}-workers"]["spec"]["ingress"][0]
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    assert any(
        (p.get("namespaceSelector") or {}).get("matchLabels") == monitoring
        for p in http_rule["from"]
    )
    for obj in [secret, *children]:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    readme = (TENANTS / "README.md").read_text()
    for name in ("tenants-secret.yaml", "pool.yaml"):
        assert f"kubectl apply -f examples/tenants/{name}" in readme
    assert "[`tenants/`](tenants/)" in (EXAMPLES / "README.md").read_text()


def test_the_placeholder_keys_let_nobody_in_until_replaced() -> None:
    """An unedited copy of the Secret is refused by the router (no key of it can be sent),
    naming the tenant and the key's number, never its text; with real keys it is read."""
    import secrets

    from kvpool.router.admission.tenants import TenantsError, parse_tenants

    text = tenants_documents()["Secret"]["stringData"]["tenants.yaml"]
    with pytest.raises(TenantsError) as refused:
        parse_tenants(text)
    assert "key #1" in str(refused.value) and "REPLACE" not in str(refused.value)
    data = yaml.safe_load(text)
    for tenant in data["tenants"]:
        tenant["keys"] = [secrets.token_hex(32) for _ in tenant["keys"]]
    tenants = {t.name: t for t in parse_tenants(yaml.safe_dump(data))}
    assert tenants["chat"].priority == "high" and tenants["batch"].priority == "low"
    assert tenants["ops"].admin and not tenants["chat"].admin


def test_kvpool_check_passes_on_the_tenants_pool() -> None:
    exe = shutil.which("kvpool", path=str(Path(sys.executable).parent)) or "kvpool"
    path = str(TENANTS / "pool.yaml")
    out = subprocess.run(
        [exe, "check", path],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"{path}: InferencePool tiny-keys: valid" in out.stdout
