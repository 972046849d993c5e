"""The pool's I/O loops (:class:`.pool.WorkerPool`): each worker's health checks and
registration, its model cards, its load scrape, and taking it out of rotation."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from kvpool.hashing import HASH_ALGORITHM
from kvpool.openai_api import WorkerInfo
from kvpool.signing import kv_events_credential

from .scrape import (
    CACHE_CONFIG_INFO,
    ITL_COUNT,
    ITL_SUM,
    _engines,
    _raise_for_status,
    info_label_sets,
    parse_load,
)
from .worker import WorkerState, _boot

__all__ = ["Probes"]

#: the pool's own logger: these are the pool's loops
log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".pool")


class Probes:
    """:class:`.pool.WorkerPool`'s health, registration, model and load loops."""

    # -- health and registration ----------------------------------------------------------

    def mark_down(self, state: WorkerState, why: str, *, dead: bool = False) -> None:
        """Out of rotation now. Its index entries and its event stream stay: failing a
        check is no evidence that its cache is gone (see the module's docstring). The
        attempts in flight on it are aborted (a hung worker answers them never) when it is
        ``dead`` (its connections are refused) or fails a second check in a row: one slow
        health check of a busy worker must not send all its requests to the others."""
        if self.workers.get(state.id) is not state:
            return  # removed, or replaced under the same id: that one is not down
        was_down = state.status == "down"
        if not was_down:
            log.warning("worker %s is down: %s", state.id, why)
        state.kv_usage = state.waiting = state.running = state.scraped_at = None
        state.unaccounted_waiting = 0
        state.itl_totals = None  # a restarted worker counts from zero again
        self._set_status(state, "down")
        if dead and not state.tracked:
            # No events to show a restart: its entries are the router's own guesses, and a
            # refused connection says the process they were about is gone.
            self.feed.clear(state)
        if dead or was_down:
            self._abort_attempts(state, why)

    @staticmethod
    def _abort_attempts(state: WorkerState, why: str) -> None:
        for attempt in list(state.attempts):
            try:
                attempt.abort(f"worker {state.id} down: {why}")
            except Exception:  # one attempt's bug must not spare the others
                log.exception("worker %s: aborting an attempt failed", state.id)

    def _set_status(self, state: WorkerState, status: str) -> None:
        """A worker's new status; what the pool derives from its up workers follows."""
        state.status = status
        self.changed_roster()

    async def _health_loop(self, state: WorkerState) -> None:
        cfg = self.config
        while True:
            try:
                await self._check_health(state)
            except Exception:  # a surprise must not freeze the worker in its last status
                log.exception("worker %s: health check failed", state.id)
                self.mark_down(state, "health check failed")
            await asyncio.sleep(cfg.health_interval_s)

    async def _get(self, url: str) -> tuple[int, bytes]:
        """A GET within the health timeout (of the router's responsive time): the status
        and the body."""
        return await self.clock.within(self._get_now(url), self.config.health_timeout_s)

    async def _get_now(self, url: str) -> tuple[int, bytes]:
        untimed = aiohttp.ClientTimeout(total=None, connect=None)  # timed by the caller
        async with self.client.get(url, timeout=untimed) as resp:
            return resp.status, await resp.read()

    async def _check_health(self, state: WorkerState) -> None:
        try:
            status, _ = await self._get(state.url + "/health")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(
                exc, aiohttp.ServerTimeoutError
            )
            self.mark_down(state, f"/health: {type(exc).__name__} {exc}".strip(), dead=refused)
            return
        if status == 200:
            if state.status != "up":
                await self._register(state)
        elif state.status == "up":
            log.warning("worker %s answers /health %d", state.id, status)
            self._set_status(state, "unavailable")
        elif state.status == "registering":
            self._set_status(state, "unavailable")

    async def _register(self, state: WorkerState) -> None:
        try:
            status, body = await self._get(state.url + "/kvpool/info")
            if status == 404:
                info = None
                cards = await self._model_cards(state)
            else:
                _raise_for_status("/kvpool/info", status)
                info = WorkerInfo.model_validate_json(body)
                try:
                    cards = await self._model_cards(state)
                except Exception as exc:  # its info names its model; adapters come later
                    log.warning("worker %s: /v1/models: %s", state.id, exc)
                    cards = [{"id": info.served_model_name, "object": "model"}]
        except Exception as exc:  # whatever answers there is not a worker we understand
            log.warning("worker %s: registration failed: %s", state.id, exc)
            if state.status == "registering":
                # not in rotation, and known not to be coming
                self._set_status(state, "unavailable")
            return
        if info is not None and state.info is not None and _boot(info) != _boot(state.info):
            # Another process under the same address: what the last one held is gone.
            log.warning("worker %s restarted (a new boot id): its index entries go", state.id)
            self.feed.forget(state, remove=False)
        state.info = info
        if state.agreement is not None:
            state.agreement.restarted()
        state.set_models(cards)
        self.changed_roster()  # its info and its cards
        vllm_cache = await self._vllm_cache_config(state) if info is None else None
        if info is not None:
            state.engines = (0,)
        elif vllm_cache is not None:  # (not read this time: the ranks it had stay)
            state.engines = _engines(vllm_cache)
        slots = info.max_num_seqs if info is not None else None
        if slots is None and state.endpoint.max_num_seqs is not None:
            # its deployment's word (vLLM says it nowhere): vLLM's --max-num-seqs is per
            # engine, and a data-parallel vLLM runs one engine per rank
            slots = state.endpoint.max_num_seqs * len(state.engines)
        if slots is not None:  # before any scrape
            state.batch_capacity = slots
            state.batch_announced = True
        first = vllm_cache[0] if vllm_cache else None
        state.mismatch = self._mismatch(info) or self._vllm_mismatch(first)
        state.compatible = state.mismatch is None
        if state.mismatch:
            log.error(
                "worker %s: %s; it gets requests but no cache credit", state.id, state.mismatch
            )
            state.mismatches += 1
        events = self._events_endpoints(state)
        state.tracked = events is not None
        if state.subscriber is not None and (events is None or not state.compatible):
            self.feed.forget(state, remove=False)  # its stream is no longer to be read
        self.feed.track(state)
        ranks = state.engines
        if events is not None and state.compatible and self.feed.streaming(state, *events, ranks):
            pass  # its stream ran on while it was out: nothing was lost, nothing to replay
        elif events is not None and state.compatible:
            secret = self.config.pool_secret
            # Only a kvpool worker (it has /kvpool/info) checks the credential; a vLLM
            # publisher speaks ZMQ's NULL mechanism and would refuse one.
            credential = kv_events_credential(secret) if secret and state.info else None
            self.feed.start(state, *events, credential, ranks)
            self._set_status(state, "syncing")
            started = time.monotonic()
            if not await self.feed.caught_up(state, self.config.index_sync_timeout_s):
                log.warning(
                    "worker %s: its KV event history did not replay within %.0f s; it is in "
                    "rotation before its index caught up",
                    state.id,
                    self.config.index_sync_timeout_s,
                )
            elif state.events_seen:
                log.info(
                    "worker %s: %d KV events of its history replayed in %.2f s",
                    state.id,
                    state.events_seen,
                    time.monotonic() - started,
                )
            if self.workers.get(state.id) is not state or state.status != "syncing":
                return  # removed, or taken down, while it synced
        self._set_status(state, "up")
        self.changed.set()
        log.info(
            "worker %s is up: model %s, %s",
            state.id,
            state.model,
            "KV events " + events[0] if events else "no KV events (approximate tracking)",
        )

    async def _model_cards(self, state: WorkerState) -> list[dict[str, Any]]:
        """The worker's ``/v1/models`` cards; one without a string id is left out."""
        status, body = await self._get(state.url + "/v1/models")
        _raise_for_status("/v1/models", status)
        data = json.loads(body).get("data") or []
        if not isinstance(data, list):
            raise ValueError("/v1/models: data is not a list")
        return [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]

    async def _models_loop(self, state: WorkerState) -> None:
        """Adapters come and go at run time (vLLM's ``/v1/load_lora_adapter``): read the
        list again now and then; a failed read keeps the last one."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.models_interval_s)
            if state.status != "up":
                continue  # registration reads it when the worker is back
            try:
                cards = await self._model_cards(state)
            except Exception as exc:
                log.debug("worker %s: /v1/models: %s", state.id, exc)
                continue
            if state.status != "up":
                continue  # went down meanwhile: registration reads it again
            before = state.models
            state.set_models(cards)
            self.changed_roster()
            if state.models != before:
                log.info(
                    "worker %s serves %s (was %s)",
                    state.id,
                    sorted(state.models),
                    sorted(before),
                )

    def _mismatch(self, info: WorkerInfo | None) -> str | None:
        cfg = self.config
        if info is None:
            return None
        problems = []
        if info.block_size != cfg.block_size:
            problems.append(f"block size {info.block_size}, the router's {cfg.block_size}")
        if info.hash_seed != cfg.hash_seed:
            problems.append(f"hash seed {info.hash_seed!r}, the router's {cfg.hash_seed!r}")
        if info.hash_algo != HASH_ALGORITHM:
            problems.append(f"hash {info.hash_algo}, the router's {HASH_ALGORITHM}")
        if cfg.served_model_name and info.served_model_name != cfg.served_model_name:
            problems.append(
                f"model {info.served_model_name!r}, the router tokenizes for "
                f"{cfg.served_model_name!r}"
            )
        return "; ".join(problems) or None

    async def _vllm_cache_config(self, state: WorkerState) -> list[dict[str, str]] | None:
        """The labels of a vLLM worker's ``vllm:cache_config_info`` (its block size, prefix
        caching and hash algorithm), one set per engine (data-parallel rank), or None where
        its ``/metrics`` has none."""
        try:
            status, body = await self._get(state.url + "/metrics")
            _raise_for_status("/metrics", status)
        except Exception as exc:  # checked again at the next registration
            log.debug("worker %s: /metrics: %s", state.id, exc)
            return None
        return info_label_sets(body.decode(errors="replace"), CACHE_CONFIG_INFO) or None

    def _vllm_mismatch(self, labels: dict[str, str] | None) -> str | None:
        """What a vLLM worker's cache configuration says the router would get wrong: vLLM
        does not say its hash seed, but its block size, prefix caching and hash are in
        ``vllm:cache_config_info``."""
        if not labels:
            return None
        cfg = self.config
        problems = []
        size = labels.get("hash_block_size", "None")
        size = labels.get("block_size", "None") if size == "None" else size
        if size.isdigit() and int(size) != cfg.block_size:
            problems.append(
                f"vLLM hashes blocks of {size} tokens, the router {cfg.block_size} "
                f"(start the router with --block-size {size})"
            )
        if labels.get("enable_prefix_caching") == "False":
            problems.append("vLLM runs without prefix caching (--enable-prefix-caching)")
        algo = labels.get("prefix_caching_hash_algo")
        if algo and algo != HASH_ALGORITHM:
            problems.append(
                f"vLLM hashes with {algo}, the router with {HASH_ALGORITHM} "
                f"(--prefix-caching-hash-algo {HASH_ALGORITHM})"
            )
        return "; ".join(problems) or None

    @staticmethod
    def _events_endpoints(state: WorkerState) -> tuple[str, str | None, str] | None:
        e = state.endpoint
        if e.kv_events_endpoint:
            return e.kv_events_endpoint, e.kv_events_replay_endpoint, ""
        if state.info is not None and state.info.kv_events is not None:
            ev = state.info.kv_events
            return ev.endpoint, ev.replay_endpoint, ev.topic
        return None

    def check_cache(self, state: WorkerState, predicted: int, reported: int | None) -> None:
        """An answer's ``reported`` cached prompt tokens against the ``predicted``: see
        :mod:`.agreement`. A verdict that changes counts in ``kvpool_router_worker_cache_flags``."""
        check = state.agreement
        if check is None or state.id not in self.workers:
            return
        events = self.feed.confirmations(state) if state.tracked else None
        if check.observe(predicted, reported, events) and check.flagged:
            state.cache_flags += 1

    # -- load -----------------------------------------------------------------------------

    async def _scrape_loop(self, state: WorkerState) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.scrape_interval_s)
            if state.status == "up":
                await self.scrape(state)

    async def scrape(self, state: WorkerState) -> bool:
        """One reading of a worker's load from its ``/metrics``: whether it came. A
        vLLM-size page costs the router ~0.4 ms of CPU a scrape, fetch included
        (``bench/scrape.py``): no thread hop needed."""
        # the requests routers know to be waiting for a first token there (decode legs, which
        # wait for a KV transfer in the worker's queue, too), as the page is read
        known = len(state.queued) + state.peer_prefilling
        try:
            status, body = await self._get(state.url + "/metrics")
            _raise_for_status("/metrics", status)
            values = parse_load(body.decode(errors="replace"))
        except Exception as exc:  # no load reading this time; it goes stale, then unknown
            log.debug("worker %s: /metrics: %s", state.id, exc)
            return False
        state.kv_usage = values.get("vllm:kv_cache_usage_perc")
        state.waiting = values.get("vllm:num_requests_waiting")
        state.running = values.get("vllm:num_requests_running")
        # counted against the more the routers knew of while the page was read: a request
        # whose first token came meanwhile was not waiting when the worker wrote it
        known = max(known, len(state.queued) + state.peer_prefilling)
        state.unaccounted_waiting = max(0, int(state.waiting or 0) - known)
        queueing = state.waiting and state.running and state.waiting >= 1
        if queueing and not state.batch_announced:
            state.batch_capacity = max(state.batch_capacity or 0, int(state.running or 0))
        state.scraped_at = time.monotonic()
        state.learn_itl(values.get(ITL_SUM), values.get(ITL_COUNT))
        return True
