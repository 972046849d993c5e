"""Reading a worker's Prometheus text: its load gauges, ITL histogram and vLLM's cache
configuration, found by name without parsing the whole page."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

__all__ = ["LOAD_METRICS", "SCRAPED_SERIES", "info_label_sets", "parse_load"]


def _raise_for_status(path: str, status: int) -> None:
    if status >= 400:
        raise ValueError(f"{path} answered {status}")


LOAD_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
)
ITL_HISTOGRAM = "vllm:inter_token_latency_seconds"
ITL_SUM, ITL_COUNT = ITL_HISTOGRAM + "_sum", ITL_HISTOGRAM + "_count"


#: the series a scrape reads: the load gauges, and the ITL histogram's sum and count
SCRAPED_SERIES = (*LOAD_METRICS, ITL_SUM, ITL_COUNT)


CACHE_CONFIG_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_label_sets(text: str, name: str) -> list[dict[str, str]]:
    """The labels of every sample of an info gauge in Prometheus text (a data-parallel
    vLLM writes one per engine)."""
    return [
        dict(_LABEL.findall(rest[: rest.rfind("}") + 1]))
        for rest in _sample_lines(text, name)
        if rest.startswith("{")
    ]


def _engines(labels: list[dict[str, str]] | None) -> tuple[int, ...]:
    """The data-parallel ranks a vLLM's ``vllm:cache_config_info`` names (its ``engine``
    label); rank 0 alone where it names none."""
    ranks = {int(e) for series in labels or () if (e := series.get("engine", "")).isdecimal()}
    return tuple(sorted(ranks)) or (0,)


def parse_load(text: str) -> dict[str, float]:
    """The load gauges of a worker's Prometheus text, summed over label sets (a worker
    serves one model, but a data-parallel vLLM reports one series per engine); the KV
    usage is the highest engine's. Also the inter-token latency histogram's ``_sum`` and
    ``_count``, summed over label sets: their growth between two scrapes gives the mean
    time per output token meanwhile.

    Only the lines of :data:`SCRAPED_SERIES` are read, found with ``str.find``: a vLLM page
    is thousands of lines, mostly histogram buckets, and parsing it whole took ~10 ms a
    scrape (a core at 100 workers); finding five series takes tens of microseconds."""
    out: dict[str, float] = {}
    for name in SCRAPED_SERIES:
        # A NaN or an infinity says nothing about load: such samples are left out.
        values = [v for v in _sample_values(text, name) if math.isfinite(v)]
        if values:
            out[name] = max(values) if name.endswith("_perc") else sum(values)
    return out


def _sample_lines(text: str, name: str) -> Iterator[str]:
    """What follows ``name`` on each line of Prometheus text that begins with it (its
    labels and value, or a longer name's rest: the caller tells)."""
    n, start = len(name), 0
    while (i := text.find(name, start)) >= 0:
        start = i + n
        if i and text[i - 1] != "\n":
            continue  # within a line: a comment, or a name that ends with this one
        end = text.find("\n", i)
        yield text[i + n : end if end >= 0 else len(text)]


def _sample_values(text: str, name: str) -> Iterator[float]:
    """The values of the samples of one series in Prometheus text: lines that begin with
    ``name``, then labels in braces or a space (not a longer name, not a comment)."""
    for rest in _sample_lines(text, name):
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :] if "}" in rest else ""
        elif not rest.startswith((" ", "\t")):
            continue  # a longer name
        fields = rest.split()
        if fields:
            try:
                yield float(fields[0])
            except ValueError:
                continue
