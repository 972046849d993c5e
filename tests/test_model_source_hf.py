"""The Hugging Face model source: what the operator renders for it, and the download that
the rendered init containers run, against a fake Hub on loopback.

The fake Hub serves the few endpoints ``snapshot_download`` calls (huggingface_hub follows
``HF_ENDPOINT``): the revision's commit (``/api/models/{repo}/revision/{rev}``), the file
list at that commit (``/api/models/{repo}/tree/{commit}``) and each file
(``/{repo}/resolve/{commit}/{path}``, HEAD then GET), with the Hub's error codes for a
refused token, a missing repository and a missing revision. The repository it serves is
the tiny model that ``kvpool worker make-tiny-model`` writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import kubernetes_validate
import pytest

from kvpool.api import validate_pool
from kvpool.operator.render import (
    _VLLM_FETCH,
    _WEIGHT_GLOBS,
    HF_CACHE_MOUNT,
    HF_SNAPSHOT,
    MODEL_MOUNT,
    Images,
    Manifest,
    render,
)

REPO = "kvpool-test/tiny-llama"
TOKEN = "hf_kvpoolTestTokenDoNotPrint0123456789"
SECRET = "hf-token"
NS = "llm"
IMAGES = Images()


def hf_source(**fields: Any) -> dict[str, Any]:
    return {"repo": REPO, "revision": "main", "tokenSecretRef": {"name": SECRET}, **fields}


def spec(engine: str = "kvpool", **fields: Any) -> dict[str, Any]:
    return {
        "model": {"name": "tiny", "source": {"huggingface": hf_source(**fields)}},
        "engine": {"type": engine},
    }


def children(raw: dict[str, Any]) -> list[Manifest]:
    return render("p", NS, validate_pool("p", raw), IMAGES)


def deployment(manifests: list[Manifest], name: str) -> Manifest:
    [found] = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name]
    return found


def pod(manifests: list[Manifest], name: str) -> Manifest:
    return deployment(manifests, name)["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def env_of(container: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def mounts_of(container: Manifest) -> dict[str, Manifest]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


# --- what the operator renders --------------------------------------------------------------


def test_kvpool_worker_downloads_in_an_init_container_and_serves_offline() -> None:
    worker_pod = pod(children(spec()), "p-decode")
    [init] = worker_pod["initContainers"]
    [worker] = worker_pod["containers"]
    assert init["name"] == "fetch-model"
    assert init["image"] == worker["image"] == IMAGES.worker_cpu  # no extra image to pull
    assert init["command"] == ["kvpool", "worker", "fetch-model"]
    args = init["args"]
    assert (flag(args, "--repo"), flag(args, "--revision")) == (REPO, "main")
    assert (flag(args, "--cache-dir"), flag(args, "--dir")) == (HF_CACHE_MOUNT, HF_SNAPSHOT)
    assert "--include" not in args  # workers take the whole snapshot
    # the engine reads the link offline, with both volumes mounted read-only
    assert flag(worker["args"], "--model") == HF_SNAPSHOT
    assert env_of(worker)["HF_HUB_OFFLINE"] == "1"
    assert mounts_of(worker)[MODEL_MOUNT]["readOnly"] is True
    assert mounts_of(worker)[HF_CACHE_MOUNT]["readOnly"] is True
    assert not mounts_of(init)[MODEL_MOUNT].get("readOnly")
    assert not mounts_of(init)[HF_CACHE_MOUNT].get("readOnly")
    # no claim named: a per-pod emptyDir
    volumes = {v["name"]: v for v in worker_pod["volumes"]}
    assert volumes["model"] == {"name": "model", "emptyDir": {}}
    assert volumes["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}
    # restricted like the worker: read-only root, its caches under the writable /tmp
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert mounts_of(init)["/tmp"]["name"] == "tmp"
    assert "fsGroup" not in worker_pod["securityContext"]


def test_a_cache_claim_is_shared_by_the_workers_and_writable_by_their_group() -> None:
    manifests = children(spec(cacheClaimName="hf-cache-claim"))
    for name in ("p-decode",):
        worker_pod = pod(manifests, name)
        volumes = {v["name"]: v for v in worker_pod["volumes"]}
        assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache-claim"}
        assert volumes["model"] == {"name": "model", "emptyDir": {}}  # the link stays per pod
        assert worker_pod["securityContext"]["fsGroup"] == 65532  # the images' group
        assert worker_pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    router_volumes = {v["name"]: v for v in pod(manifests, "p-router")["volumes"]}
    assert router_volumes["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}  # tokenizer only


def test_vllm_worker_downloads_with_the_vllm_image() -> None:
    manifests = children(spec("vllm", cacheClaimName="hf-cache-claim"))
    worker_pod = pod(manifests, "p-decode")
    [init] = worker_pod["initContainers"]
    [worker] = worker_pod["containers"]
    assert init["image"] == worker["image"] == IMAGES.vllm
    assert init["command"] == ["python3", "-c", _VLLM_FETCH]
    assert init["args"] == [REPO, "main", HF_CACHE_MOUNT, HF_SNAPSHOT]
    assert worker["args"][0] == HF_SNAPSHOT
    assert env_of(worker)["HF_HUB_OFFLINE"] == "1"
    # vLLM's root image runs as uid 65532 (restricted): the cache claim is written as its group
    assert worker_pod["securityContext"]["runAsUser"] == 65532
    assert worker_pod["securityContext"]["fsGroup"] == 65532


def test_router_downloads_only_the_tokenizer_into_an_empty_dir() -> None:
    manifests = children(spec("vllm"))
    router_pod = pod(manifests, "p-router")
    [init] = router_pod["initContainers"]
    assert init["image"] == IMAGES.worker_cpu  # our CLI, restricted like the router
    assert init["command"] == ["kvpool", "worker", "fetch-model"]
    args = init["args"]
    assert flag(args, "--revision") == "main"
    includes = [args[i + 1] for i, a in enumerate(args) if a == "--include"]
    excludes = [args[i + 1] for i, a in enumerate(args) if a == "--exclude"]
    assert "*.json" in includes and "*.jinja" in includes
    assert set(excludes) == set(_WEIGHT_GLOBS)
    assert env_of(init)["HF_TOKEN"] == {"secretKeyRef": {"name": SECRET, "key": "token"}}
    [config] = [m for m in manifests if m["kind"] == "ConfigMap"]
    assert config["data"]["KVPOOL_ROUTER_MODEL"] == HF_SNAPSHOT
    [router] = router_pod["containers"]
    assert mounts_of(router)[MODEL_MOUNT]["readOnly"] is True


def test_a_new_revision_changes_every_pod_template() -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    for engine in ("kvpool", "vllm"):
        before, after = children(spec(engine)), children(spec(engine, revision=sha))
        for name in ("p-decode", "p-router"):
            old = deployment(before, name)["spec"]["template"]
            new = deployment(after, name)["spec"]["template"]
            assert old != new, (engine, name)
            assert sha in json.dumps(new["spec"]["initContainers"]), (engine, name)


def test_the_token_is_only_ever_a_reference_to_the_secret() -> None:
    for engine in ("kvpool", "vllm"):
        manifests = children(spec(engine, tokenSecretRef={"name": SECRET, "key": "hf"}))
        for m in (m for m in manifests if m["kind"] == "Deployment"):
            pod_spec = m["spec"]["template"]["spec"]
            for c in pod_spec["containers"]:
                assert "HF_TOKEN" not in env_of(c), "the engine never sees the token"
            for c in pod_spec["initContainers"]:
                [entry] = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
                assert entry == {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "hf"}},
                }
        # the only Secret is the pool's own (its key made in the cluster): no token in it
        secrets = [m for m in manifests if m["kind"] == "Secret"]
        assert all(m["metadata"]["name"].endswith("-pool-secret") for m in secrets)
        assert not [m for m in secrets if "data" in m or "stringData" in m]
    # and the spec has no place for a token itself
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        validate_pool("p", spec(token=TOKEN))
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        validate_pool("p", spec(tokenSecretRef={"name": SECRET, "value": TOKEN}))


def test_a_public_repository_needs_no_secret() -> None:
    raw = spec()
    del raw["model"]["source"]["huggingface"]["tokenSecretRef"]
    for m in (m for m in children(raw) if m["kind"] == "Deployment"):
        for c in m["spec"]["template"]["spec"]["initContainers"]:
            assert "HF_TOKEN" not in env_of(c)


@pytest.mark.parametrize("engine", ["kvpool", "vllm"])
def test_rendered_objects_are_valid_kubernetes(engine: str) -> None:
    for m in children(spec(engine, cacheClaimName="hf-cache-claim")):
        kubernetes_validate.validate(m, "1.31.0", strict=True)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"repo": "tiny-llama"}, "repo: not a Hugging Face repository id: 'tiny-llama'"),
        ({"repo": "org/na me"}, "repo: not a Hugging Face repository id"),
        ({"repo": "org/-name"}, "repo: not a Hugging Face repository id"),
        ({"repo": "o/" + "n" * 95}, "repo: not a Hugging Face repository id"),
        ({"revision": ""}, "revision: not a branch, tag or commit sha: ''"),
        ({"revision": "main branch"}, "revision: not a branch, tag or commit sha"),
        ({"revision": "-main"}, "revision: not a branch, tag or commit sha"),
        ({"revision": "v" * 256}, "revision: not a branch, tag or commit sha"),
        ({"tokenSecretRef": {"name": "HF_Token"}}, "tokenSecretRef.name: not a DNS-1123 name"),
        ({"tokenSecretRef": {"name": "hf", "key": "a b"}}, "tokenSecretRef.key: String should"),
        ({"cacheClaimName": "Cache"}, "cacheClaimName: not a DNS-1123 name: 'Cache'"),
    ],
)
def test_bad_names_are_refused_naming_the_field(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError) as exc_info:
        validate_pool("p", spec(**fields))
    assert f"spec.model.source.huggingface.{problem}" in str(exc_info.value)


def test_the_revision_is_required() -> None:
    raw = spec()
    del raw["model"]["source"]["huggingface"]["revision"]
    with pytest.raises(ValueError, match=r"huggingface\.revision: Field required"):
        validate_pool("p", raw)


def test_hugging_face_is_one_source_among_the_others() -> None:
    raw = spec()
    raw["model"]["source"]["pvc"] = {"claimName": "models"}
    with pytest.raises(ValueError, match=r"exactly one model source: .* or huggingface"):
        validate_pool("p", raw)
    accepted = validate_pool("p", spec(revision="refs/pr/1", cacheClaimName="hub.cache"))
    assert accepted.model.source.huggingface.revision == "refs/pr/1"


# --- a fake Hugging Face Hub ----------------------------------------------------------------


class FakeHub:
    """One repository with one branch, ``main``, at one commit; every request is recorded."""

    def __init__(self, repo: str, files: dict[str, bytes], token: str | None) -> None:
        self.repo, self.files, self.token = repo, files, token
        self.commit = hashlib.sha1(b"".join(sorted(files.values()))).hexdigest()
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join(timeout=10)
        self.server.server_close()

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        auth = req.headers.get("Authorization")
        self.requests.append((req.command, path, auth))
        api = re.fullmatch(r"/api/models/(.+)/(revision|tree)/([^/]+)", path)
        resolve = re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", path)
        repo = api.group(1) if api else resolve.group(1) if resolve else None
        if repo is None:
            return self.send(req, 404, body, error="EntryNotFound")
        if repo != self.repo:
            return self.send(req, 404, body, error="RepoNotFound")
        if self.token is not None and auth != f"Bearer {self.token}":
            if auth is None:  # the Hub hides a private repository from the anonymous
                return self.send(req, 401, body, error="RepoNotFound")
            return self.send(req, 401, body, message="Invalid credentials in Authorization header")
        revision = api.group(3) if api else resolve.group(2)
        if revision not in ("main", self.commit):
            return self.send(req, 404, body, error="RevisionNotFound")
        if api and api.group(2) == "revision":
            siblings = [{"rfilename": name} for name in sorted(self.files)]
            info = {"id": self.repo, "sha": self.commit, "siblings": siblings, "private": True}
            return self.send(req, 200, body, payload=json.dumps(info).encode())
        if api:  # the tree, recursive, in one page
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": self.oid(data)}
                for name, data in sorted(self.files.items())
            ]
            return self.send(req, 200, body, payload=json.dumps(tree).encode())
        name = resolve.group(3)
        if name not in self.files:
            return self.send(req, 404, body, error="EntryNotFound")
        data = self.files[name]
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{self.oid(data)}"'}
        return self.send(req, 200, body, payload=data, headers=headers)

    @staticmethod
    def oid(data: bytes) -> str:  # git's blob id
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    @staticmethod
    def send(
        req: BaseHTTPRequestHandler,
        status: int,
        body: bool,
        payload: bytes = b"",
        error: str | None = None,
        message: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if status >= 400:
            payload = json.dumps({"error": message or error}).encode()
        req.send_response(status)
        for key, value in (headers or {}).items():
            req.send_header(key, value)
        if error:
            req.send_header("X-Error-Code", error)
        if message:
            req.send_header("X-Error-Message", message)
        req.send_header("Content-Type", "application/json" if status >= 400 else "text/plain")
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if body:
            req.wfile.write(payload)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The tiny model's files, as `kvpool worker make-tiny-model` writes them."""
    from kvpool.worker.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return {p.name: p.read_bytes() for p in sorted(Path(model).iterdir()) if p.is_file()}


@pytest.fixture
def hub(tiny_files: dict[str, bytes]) -> Iterator[FakeHub]:
    with FakeHub(REPO, tiny_files, TOKEN) as served:
        yield served


def hub_env(hub: FakeHub, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home / "hf-home"),  # as in the image: HF_HOME under the writable /tmp
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        PYTHONSAFEPATH="1",  # never import the repository's operator/ as `operator`
        NO_PROXY="127.0.0.1",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_init(container: Manifest, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a rendered init container's command here, its mount paths moved under ``root``."""
    command = [*container["command"], *container["args"]]
    command = [a.replace("/models/", f"{root}/models/") for a in command]
    if command[:3] == ["kvpool", "worker", "fetch-model"]:
        entry = "import sys; from kvpool.cli import main; sys.exit(main())"
        command = [sys.executable, "-c", entry, *command[1:]]
    elif command[0] == "python3":
        command[0] = sys.executable
    for mount in container["volumeMounts"]:
        if mount["mountPath"].startswith("/models/"):
            (root / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def init_of(manifests: list[Manifest], name: str) -> Manifest:
    [init] = pod(manifests, name)["initContainers"]
    return init


def local(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


# --- the download ---------------------------------------------------------------------------


def test_worker_init_downloads_the_branch_and_the_engine_loads_it_offline(
    hub: FakeHub, tmp_path: Path, tiny_files: dict[str, bytes]
) -> None:
    init = init_of(children(spec()), "p-decode")
    done = run_init(init, tmp_path, hub_env(hub, tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"commit {hub.commit}" in done.stdout
    assert ("GET", f"/api/models/{REPO}/revision/main", f"Bearer {TOKEN}") in hub.requests
    link = local(tmp_path, HF_SNAPSHOT)
    assert link.is_symlink() and link.resolve().name == hub.commit
    assert link.resolve().is_relative_to(local(tmp_path, HF_CACHE_MOUNT).resolve())
    assert {p.name: p.read_bytes() for p in link.iterdir()} == tiny_files
    hub.stop()  # the engine starts with no Hub to ask

    from kvpool.worker.engine import EngineConfig, LLMEngine
    from kvpool.worker.sequence import SamplingParams

    engine = LLMEngine.from_pretrained(link, EngineConfig(num_blocks=16, device="cpu"))
    [done_seq] = engine.generate(["a router"], SamplingParams(max_tokens=4, temperature=0))
    assert len(done_seq.token_ids) >= 1


def test_a_restarted_init_container_relinks_and_reuses_the_cache(
    hub: FakeHub, tmp_path: Path
) -> None:
    init = init_of(children(spec()), "p-decode")
    env = hub_env(hub, tmp_path)
    assert run_init(init, tmp_path, env).returncode == 0
    downloads = sum(1 for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p)
    again = run_init(init, tmp_path, env)
    assert again.returncode == 0, again.stderr
    assert sum(1 for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p) == downloads
    assert local(tmp_path, HF_SNAPSHOT).resolve().name == hub.commit


def test_a_commit_sha_is_fetched_without_resolving_a_branch(hub: FakeHub, tmp_path: Path) -> None:
    init = init_of(children(spec(revision=hub.commit)), "p-decode")
    done = run_init(init, tmp_path, hub_env(hub, tmp_path))
    assert done.returncode == 0, done.stderr
    assert not [p for _, p, _ in hub.requests if "/revision/" in p]
    assert local(tmp_path, HF_SNAPSHOT).resolve().name == hub.commit


def test_router_init_fetches_the_tokenizer_and_no_weights(hub: FakeHub, tmp_path: Path) -> None:
    from kvpool.tokenization import load_tokenizer

    init = init_of(children(spec("vllm")), "p-router")
    done = run_init(init, tmp_path, hub_env(hub, tmp_path))
    assert done.returncode == 0, done.stderr
    link = local(tmp_path, HF_SNAPSHOT)
    names = {p.name for p in link.iterdir()}
    assert "tokenizer.json" in names and "config.json" in names
    assert not [n for n in names if n.endswith(".safetensors")]
    assert not [p for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors")]
    tokenizer = load_tokenizer(link)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_vllm_init_script_downloads_and_links(hub: FakeHub, tmp_path: Path) -> None:
    init = init_of(children(spec("vllm")), "p-decode")
    done = run_init(init, tmp_path, hub_env(hub, tmp_path))
    assert done.returncode == 0, done.stderr
    link = local(tmp_path, HF_SNAPSHOT)
    assert link.resolve().name == hub.commit
    assert (link / "model.safetensors").is_file()
    assert TOKEN not in done.stdout + done.stderr


FAILURES = {
    "refused token": ({}, "hf_wrong", "refused the token in HF_TOKEN (HTTP 401"),
    "no token for a private repository": ({}, None, "repository not found (HTTP 401)"),
    "missing repository": ({"repo": "kvpool-test/nope"}, TOKEN, "repository not found (HTTP 404)"),
    "missing revision": ({"revision": "v9"}, TOKEN, "revision 'v9': no such revision"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
@pytest.mark.parametrize("engine", ["kvpool", "vllm"])
def test_a_failed_download_is_one_clear_line_without_the_token(
    hub: FakeHub, tmp_path: Path, engine: str, case: str
) -> None:
    fields, token, message = FAILURES[case]
    init = init_of(children(spec(engine, **fields)), "p-decode")
    done = run_init(init, tmp_path, hub_env(hub, tmp_path, token))
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    assert TOKEN not in output and "hf_wrong" not in output
    assert not local(tmp_path, HF_SNAPSHOT).exists()
    if engine == "kvpool":  # our command explains; vLLM's one-liner passes the Hub's words on
        assert done.returncode == 2
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("kvpool worker: error: ") and message in line, line
    else:
        assert done.stderr.startswith("cannot fetch ")
