"""Long prompts through a router process: a prompt far over the context is refused from its
beginning, with vLLM's context error, and what the router keeps of prompts stays within
its configured bound however many huge ones it is sent."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.stack import free_port, wait_healthy
from kvpool.tokenization import load_tokenizer, max_chars_per_token

pytestmark = pytest.mark.timeout(300)

#: the router's bound on what it keeps of prompts (its prefix token cache), configured here
TOKEN_CACHE_MIB = 0.5
#: what one request in flight may hold meanwhile (a 3 MB body, its text, its JSON), and
#: what the allocator keeps of it
IN_FLIGHT_MIB = 24

WORDS = "order ships within two days unless made returns accepted receipt café 東京".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def router_process(llama_dir: Path, worker_processes: Any) -> Any:
    (worker,) = worker_processes(1)
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
    argv += ["router", "serve", "--model", str(llama_dir), "--port", str(port)]
    argv += ["--worker", worker.url, "--token-cache-mib", str(TOKEN_CACHE_MIB)]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONSAFEPATH": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 90)
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(100):  # until the worker is up in the router: a first answer
                if client.post(
                    "/v1/completions", json={"prompt": "hi", "max_tokens": 1}
                ).is_success:
                    break
                time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(15)


def huge_prompt(rng: random.Random, size: int) -> str:
    words = [rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(size // 8)]
    return " ".join(words)[:size]


def test_huge_prompts_are_refused_and_leave_the_router_within_its_bound(
    router_process: Any, llama_dir: Path
) -> None:
    url, proc = router_process
    rng = random.Random(7)
    with httpx.Client(base_url=url, timeout=60) as client:
        context = client.get("/v1/models").json()["data"][0]["max_model_len"]
        # distinct long prompts within the context, kept by the token cache until it is
        # full (its bound: ~3 KiB each), so the baseline holds what any router serving long
        # prompts holds
        for _ in range(300):
            warm = client.post(
                "/v1/completions", json={"prompt": huge_prompt(rng, 1000), "max_tokens": 1}
            )
            assert warm.status_code == 200, warm.text[:300]
        baseline = rss_mib(proc.pid)
        bound = TOKEN_CACHE_MIB + IN_FLIGHT_MIB
        growth: list[float] = []
        base = huge_prompt(rng, 3 * 2**20)  # 3 MB: far over the context
        # vLLM refuses a text longer than the context's tokens of its longest vocabulary
        # entry in characters before tokenizing it; a shorter one over the context by its
        # tokens, counted to one past the context
        chars_bound = context * max_chars_per_token(load_tokenizer(llama_dir))
        over = huge_prompt(rng, chars_bound // 2)  # a chat's template adds characters
        for i in range(100):
            text = base if i % 4 < 2 else over
            prompt = f"Request {i}: {text}"[: len(text)]  # each one distinct from its first word
            if i % 2:
                body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
                path = "/v1/chat/completions"
            else:
                body, path = {"prompt": prompt}, "/v1/completions"
            resp = client.post(path, json={**body, "max_tokens": 1})
            assert resp.status_code == 400, resp.text[:300]
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("BadRequestError", 400)
            assert f"maximum context length is {context} tokens. However" in error["message"]
            if text is base:
                assert error["param"] == "input_text"
                assert f"more than {chars_bound} characters" in error["message"]
            else:
                assert error["param"] == "input_tokens", error
                assert f"contains at least {context + 1} input tokens" in error["message"]
            grown = rss_mib(proc.pid) - baseline
            assert grown <= bound, f"after {i + 1} prompts the router grew {grown:.0f} MiB"
            growth.append(grown)
        # and no slope: the second fifty prompts add nothing the first fifty did not
        assert growth[-1] - growth[49] <= 4, f"grew {growth[-1] - growth[49]:.1f} MiB more"
        # and it still serves
        ok = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
