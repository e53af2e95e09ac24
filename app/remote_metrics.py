"""A server's /metrics page read for the KV cache tab: Prometheus text parsed, and the cache and queue figures
that vLLM, SGLang and llama.cpp's server publish summed up under Pagoda's names.

Pure functions on the page's text: app/remote.py's client fetches it, and the tests feed them canned pages.
"""

from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')

# What the KV cache tab shows -> the names servers use for it (vLLM v1 first, then older vLLM, SGLang,
# llama.cpp's server). Counts are summed over label sets (engines, models); fractions are averaged.
COUNTS = {
    "prefix_cache_queries": ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"],
    "prefix_cache_hits": ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"],
    "num_requests_running": ["vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"],
    "num_requests_waiting": ["vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"],
}
FRACTIONS = {
    "prefix_cache_hit_rate": ["vllm:gpu_prefix_cache_hit_rate", "sglang:cache_hit_rate"],
    "kv_cache_usage": [
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ],
}


def parse_prometheus(text: str) -> dict[str, list[float]]:
    """Prometheus text format: metric name -> its values, one per label set. Comments and junk are skipped."""
    samples: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.setdefault(m.group(1), []).append(value)
    return samples


def summarize_metrics(samples: dict[str, list[float]]) -> dict:
    """The cache and queue figures a server's metrics give, under Pagoda's names (only those it has):

    prefix_cache_queries, prefix_cache_hits (tokens), prefix_cache_hit_rate (0..1, from hits/queries
    when both are there), num_requests_running, num_requests_waiting, kv_cache_usage (0..1)."""
    out: dict = {}
    for key, names in COUNTS.items():
        name = next((n for n in names if n in samples), None)
        if name is not None:
            total = sum(v for v in samples[name] if math.isfinite(v))
            out[key] = int(total) if total.is_integer() else total
    for key, names in FRACTIONS.items():
        name = next((n for n in names if n in samples), None)
        values = [v for v in samples.get(name, []) if math.isfinite(v)]
        if values:
            out[key] = sum(values) / len(values)
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"]
    return out
