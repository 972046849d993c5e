"""The engine and block size a pool gets when its spec names none.

A pool whose workers ask for GPUs runs vLLM (the current release's image); any other runs
kvpool's own engine (the CPU and development engine). The block size is 16, except for vLLM
without GPUs, whose CPU attention is built for multiples of 32. Whatever the choice, the router
is told the block size the workers are given, and the pool's status says what was chosen.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.api import InferencePoolStatus, validate_pool
from kvpool.api.crd import PRINTER_COLUMNS
from kvpool.operator.render import DEFAULT_IMAGE, Images, render
from kvpool.operator.status import Observed, build_status

NS = "llm"
MODEL = {"name": "m", "source": {"pvc": {"claimName": "models", "path": "m"}}}
GPU = {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}, "requests": {"cpu": "8"}}
CPU = {"limits": {"cpu": "4", "memory": "8Gi"}}


def children(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return render("p", NS, validate_pool("p", spec), Images())


def workers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The worker Deployments by role."""
    return {
        o["metadata"]["name"].removeprefix("p-"): o
        for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["name"] != "p-router"
    }


def worker(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"
    ]
    return c


def flag(c: dict[str, Any], name: str) -> str:
    return c["args"][c["args"].index(name) + 1]


def router_block_size(objs: list[dict[str, Any]]) -> str:
    (config,) = [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "p-router"
    ]
    return config["data"]["KVPOOL_ROUTER_BLOCK_SIZE"]


def test_a_gpu_pool_that_names_no_engine_runs_the_current_vllm_with_blocks_of_16() -> None:
    objs = children({"model": MODEL, "decode": {"replicas": 2, "resources": GPU}})
    decode = workers(objs)["decode"]
    c = worker(decode)
    assert c["command"] == ["vllm", "serve"]
    assert c["image"] == "vllm/vllm-openai:v0.32.0"  # publishes KV events map-encoded
    assert flag(c, "--block-size") == "16"  # vLLM's GPU attention's own default
    assert router_block_size(objs) == "16"
    assert decode["metadata"]["annotations"][DEFAULT_IMAGE] == "vllm"
    # vLLM's pods: no pool secret (vLLM neither signs nor checks a hand-off)
    assert not any(o["kind"] == "Secret" for o in objs)


def test_a_gpu_asked_for_by_the_prefill_role_alone_makes_the_pool_vllm() -> None:
    spec = {
        "model": MODEL,
        "disaggregation": {"mode": "Disaggregated"},
        "prefill": {"resources": {"requests": {"nvidia.com/gpu": "1"}}},
        "decode": {},
    }
    objs = children(spec)
    for role, deployment in workers(objs).items():
        assert worker(deployment)["command"] == ["vllm", "serve"], role
        assert flag(worker(deployment), "--block-size") == "16", role
    assert router_block_size(objs) == "16"


AMD = {"limits": {"amd.com/gpu": 1}}


@pytest.mark.parametrize(
    "resources",
    [{}, CPU, AMD],
    ids=["no resources", "cpu and memory", "AMD GPUs (vLLM's default image is CUDA's)"],
)
def test_a_pool_without_gpus_that_names_no_engine_runs_kvpool_workers(
    resources: dict[str, Any],
) -> None:
    objs = children({"model": MODEL, "decode": {"resources": resources}})
    c = worker(workers(objs)["decode"])
    assert c["command"] == ["kvpool", "worker", "serve"]
    assert c["image"] == Images().worker_cpu
    assert flag(c, "--block-size") == "16"
    assert router_block_size(objs) == "16"


def test_a_vllm_pool_without_gpus_gets_blocks_of_32_on_both_sides() -> None:
    objs = children({"model": MODEL, "engine": {"type": "vllm"}, "decode": {"resources": CPU}})
    c = worker(workers(objs)["decode"])
    assert c["command"] == ["vllm", "serve"]
    assert flag(c, "--block-size") == "32"  # vLLM's CPU attention is built for multiples of 32
    assert router_block_size(objs) == "32"


@pytest.mark.parametrize(
    ("engine", "resources", "command", "block_size"),
    [
        ({"type": "kvpool", "blockSize": 64}, GPU, "kvpool", "64"),
        ({"type": "kvpool"}, GPU, "kvpool", "16"),
        ({"type": "vllm", "blockSize": 16}, CPU, "vllm", "16"),
        ({"blockSize": 128}, GPU, "vllm", "128"),
        ({"blockSize": 20}, CPU, "kvpool", "20"),
    ],
    ids=["kvpool on gpus, 64", "kvpool on gpus", "vllm on cpu, 16", "gpus, 128", "cpu, 20"],
)
def test_an_engine_type_and_block_size_the_spec_names_are_kept(
    engine: dict[str, Any], resources: dict[str, Any], command: str, block_size: str
) -> None:
    objs = children({"model": MODEL, "engine": engine, "decode": {"resources": resources}})
    c = worker(workers(objs)["decode"])
    assert c["command"][0] == command
    assert flag(c, "--block-size") == block_size
    assert router_block_size(objs) == block_size
    if command == "kvpool" and resources is GPU:
        assert c["image"] == Images().worker  # kvpool's CUDA image, as before


@pytest.mark.parametrize(
    ("spec", "engine"),
    [
        (
            {"model": MODEL, "decode": {"resources": GPU}},
            {
                "type": "vllm",
                "blockSize": 16,
                "chosen": [
                    "engine.type unset: vllm (decode asks for nvidia.com/gpu)",
                    "engine.blockSize unset: 16 (vLLM's default on GPUs)",
                ],
            },
        ),
        (
            {"model": MODEL},
            {
                "type": "kvpool",
                "blockSize": 16,
                "chosen": [
                    "engine.type unset: kvpool (no worker role asks for a GPU)",
                    "engine.blockSize unset: 16 (the default)",
                ],
            },
        ),
        (
            {"model": MODEL, "engine": {"type": "vllm"}},
            {
                "type": "vllm",
                "blockSize": 32,
                "chosen": [
                    "engine.blockSize unset: 32 (vLLM without GPUs: its CPU attention is"
                    " built for multiples of 32)"
                ],
            },
        ),
        (
            {
                "model": MODEL,
                "engine": {"type": "kvpool", "blockSize": 8},
                "decode": {"resources": GPU},
            },
            {"type": "kvpool", "blockSize": 8, "chosen": []},
        ),
    ],
    ids=["gpus", "no gpus", "vllm on cpu", "all named"],
)
def test_the_pools_status_says_which_engine_runs_and_what_the_operator_chose(
    spec: dict[str, Any], engine: dict[str, Any]
) -> None:
    status = build_status(validate_pool("p", spec), Observed(1, {}), None, "T1")
    assert status["engine"] == engine
    assert InferencePoolStatus.model_validate(status).engine is not None  # the CRD keeps it
    # kubectl get kvpool -o wide shows it
    (column,) = [c for c in PRINTER_COLUMNS if c["name"] == "Engine"]
    assert column["jsonPath"] == ".status.engine.type"


def test_a_status_without_a_valid_spec_names_no_engine() -> None:
    status = build_status(None, Observed(1, {}, error="spec.model: Field required"), None, "T1")
    assert "engine" not in status
