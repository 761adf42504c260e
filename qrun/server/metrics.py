"""The server's Prometheus numbers (/metrics): engine gauges, request counts and latency histograms."""

from __future__ import annotations

from dataclasses import dataclass, field

from qrun.server.job import Job

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts):
            lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}",
                  f"{name}_count {self.count}"]
        return lines


@dataclass
class ServerMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    requests_by_status: dict[int, int] = field(default_factory=dict)
    prompt_tokens: int = 0

    def record(self, job: Job, status: int, finished: float) -> None:
        """Count one answered generation request; its tokens and timings only if it succeeded."""
        self.requests_by_status[status] = self.requests_by_status.get(status, 0) + 1
        if status != 200:
            return
        self.prompt_tokens += job.prompt_tokens
        self.latency.observe(finished - job.started)
        per_choice = job.completion_tokens / max(1, job.params.n * len(job.prompts))
        if job.first_token is not None and per_choice > 1:
            self.tpot.observe((finished - job.first_token) / (per_choice - 1))

    def render(self, stats: dict[str, float], in_flight: int) -> str:
        def gauge(name: str, value: float, help_text: str, kind: str = "gauge") -> list[str]:
            return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]

        lines = [
            *gauge("qrun_requests_running", stats.get("running", 0), "Sequences the engine is running."),
            *gauge("qrun_requests_waiting", stats.get("waiting", 0), "Sequences waiting for a slot or blocks."),
            *gauge("qrun_http_requests_in_flight", in_flight, "Generation requests the server holds."),
            *gauge("qrun_kv_blocks_used", stats.get("kv_blocks_used", 0), "KV cache blocks in use."),
            *gauge("qrun_kv_blocks_free", stats.get("kv_blocks_free", 0), "KV cache blocks free."),
            *gauge("qrun_kv_blocks_total", stats.get("kv_blocks_total", 0), "KV cache blocks in all."),
            *gauge("qrun_kv_blocks_cached", stats.get("kv_blocks_cached", 0),
                   "Free blocks still holding a reusable prefix."),
            *gauge("qrun_kv_block_references", stats.get("kv_block_references", 0),
                   "Sequences' references to KV blocks, summed (prefix sharing counts each)."),
            *gauge("qrun_prefix_cache_hit_rate", stats.get("prefix_hit_rate", 0.0),
                   "Share of prompt blocks served from the prefix cache."),
            *gauge("qrun_preemptions_total", stats.get("num_preemptions", 0), "Sequences preempted.", "counter"),
            *gauge("qrun_generation_tokens_total", stats.get("generated_tokens", 0),
                   "Tokens the engine generated.", "counter"),
            *gauge("qrun_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests.",
                   "counter"),
            "# HELP qrun_http_requests_total Generation requests answered, by HTTP status.",
            "# TYPE qrun_http_requests_total counter",
            *(f'qrun_http_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests_by_status.items())),
            *self.ttft.render("qrun_time_to_first_token_seconds", "Arrival to first token."),
            *self.tpot.render("qrun_time_per_output_token_seconds", "Mean gap between output tokens, per request."),
            *self.latency.render("qrun_e2e_request_latency_seconds", "Arrival to the last token."),
        ]
        return "\n".join(lines) + "\n"
