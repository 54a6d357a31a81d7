"""Markdown reports of a results file, and side-by-side comparisons of several.

A report states what a reader needs to judge the numbers (book §31.7): arrivals and counting,
warmup, failures, concurrency and the window's endpoints, per-request results beside the
distributions, gate violations, and goodput beside (never inside) raw throughput.
"""

from __future__ import annotations

from typing import Any

from kvserve.bench.metrics import STATS

# Rows past this many are summarized, so a 10,000-request report stays readable.
MAX_REQUEST_ROWS = 50


def fmt(value: Any, missing: str = "–") -> str:
    if value is None:
        return missing
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _ms(seconds: float | None, missing: str = "–") -> str:
    return fmt(None if seconds is None else seconds * 1000, missing)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _request_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for i, rec in enumerate(res["requests"][:MAX_REQUEST_ROWS]):
        # An error message must not break the table: no pipes or newlines, and kept short.
        status = (rec["error"] or rec["finish_reason"] or "ok").replace("|", "/").replace("\n", " ")[:120]
        rows.append(
            [
                rec["id"],
                _ms(rec["arrival"]),
                _ms(res["ttfts"][i]),
                # A request with one output has no post-first-token gap: its TPOT is missing.
                _ms(res["tpots"][i], missing="missing" if res["ttfts"][i] is not None else "–"),
                _ms(res["e2els"][i]),
                str(res["output_lens"][i]),
                ", ".join(_ms(g) for g in res["itls"][i]) or "–",
                status,
            ]
        )
    return rows


def markdown(res: dict[str, Any], title: str = "kvserve bench") -> str:
    meta = res.get("meta", {})
    lines = [f"# {title}", ""]
    # Nested objects (raw engine snapshots) stay in the JSON; the report names them only.
    for key, value in meta.items():
        lines.append(f"- **{key}**: {'(in the JSON)' if key == 'engine_stats' else fmt(value)}")
    lines += ["", f"## Per request (ms; {len(res['requests'])} requests)", ""]
    header = ["request", "arrival", "TTFT", "TPOT", "E2E", "outputs", "ITL gaps", "status"]
    lines += _table(header, _request_rows(res))
    if len(res["requests"]) > MAX_REQUEST_ROWS:
        lines += ["", f"({len(res['requests']) - MAX_REQUEST_ROWS} more in the JSON's `requests`.)"]

    win = res["window"]
    lines += ["", "## Throughput", ""]
    rows = [
        [
            "drain (first arrival → last completion)",
            f"{fmt(res['duration'])} s",
            fmt(res["total_output_tokens"]),
            fmt(res["output_throughput"]),
            fmt(res["request_throughput"]),
        ]
    ]
    if win["kind"] == "fixed":
        rows.append(
            [
                f"fixed [{fmt(win['start_ms'])}, {fmt(win['end_ms'])}] ms",
                f"{fmt(win['duration'])} s",
                fmt(win["output_tokens"]),
                fmt(win["output_throughput"]),
                fmt(win["request_throughput"]),
            ]
        )
    lines += _table(["window", "length", "output tokens", "output tok/s", "requests/s"], rows)
    lines += [
        "",
        f"Completed {res['completed']}, failed {res['failed']}; "
        f"total token throughput (input + output, drain) {fmt(res['total_token_throughput'])} tok/s.",
    ]

    lines += ["", "## Latency distributions (ms)", ""]
    rows = [[m.upper()] + [fmt(res.get(f"{s}_{m}_ms")) for s in STATS] for m in ("ttft", "tpot", "itl", "e2el")]
    lines += _table(["metric", *STATS], rows)
    if res["tpot_missing"]:
        missing = ", ".join(res["tpot_missing"])
        lines += ["", f"TPOT missing (one output; excluded, not counted as zero): {missing}."]

    gates, good = res["gates"], res["goodput"]
    lines += ["", "## Gates (hard bounds: reported, never traded for throughput)", ""]
    lines.append(f"TTFT ≤ {fmt(gates['ttft_ms'])} ms, TPOT ≤ {fmt(gates['tpot_ms'])} ms.")
    violations = gates["violations"]
    if violations:
        lines += [""] + _table(
            ["request", "metric", "value ms", "limit ms"],
            [[v["id"], v["metric"].upper(), fmt(v["value_ms"]), fmt(v["limit_ms"])] for v in violations],
        )
    else:
        lines.append("No violations.")

    lines += ["", "## Goodput (acceptable AND within every gate, per second of the window)", ""]
    lines.append(
        f"{good['good']} good of {good['completed_in_window']} completed in the {win['kind']} window "
        f"({good['with_criterion']} with an accept criterion, {good['accepted']} accepted, "
        f"{good['within_gates']} within gates): {fmt(good['request_goodput'])} good requests/s, "
        f"beside {fmt(win['request_throughput'])} completed requests/s."
    )
    if good["rejected_ids"]:
        lines.append(f"Rejected by their accept criterion: {', '.join(good['rejected_ids'])}.")

    cost = res.get("cost")
    if cost:
        lines += ["", "## Cost (charged exactly over the window, no minimum billing)", ""]
        lines.append(
            f"USD {fmt(cost['price_per_hour'])}/h × {fmt(cost['window_duration'])} s = "
            f"USD {fmt(cost['dollars'])}; per 1,000 output tokens USD {fmt(cost['per_1k_output_tokens'])}; "
            f"per acceptable answer USD {fmt(cost['per_acceptable_answer'])}."
        )
    return "\n".join(lines) + "\n"


def _window_name(window: dict[str, Any] | None) -> str | None:
    if not window:
        return None
    if window["kind"] == "fixed":
        return f"fixed [{fmt(window['start_ms'])}, {fmt(window['end_ms'])}] ms"
    return f"drain {fmt(window['duration'] * 1000)} ms"


# (label, how to read it from a results file); also reads `vllm bench serve` result files.
COMPARE_ROWS: list[tuple[str, Any]] = [
    ("window", lambda r: _window_name(r.get("window"))),
    ("completed", lambda r: r.get("completed")),
    ("failed", lambda r: r.get("failed")),
    ("duration (drain, s)", lambda r: r.get("duration")),
    ("request_throughput", lambda r: r.get("request_throughput")),
    ("output_throughput", lambda r: r.get("output_throughput")),
    ("total_token_throughput", lambda r: r.get("total_token_throughput")),
    *(
        (f"{s}_{m}_ms", lambda r, key=f"{s}_{m}_ms": r.get(key))
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "median", "p99")
    ),
    ("window output_throughput", lambda r: (r.get("window") or {}).get("output_throughput")),
    ("gate violations", lambda r: len(r["gates"]["violations"]) if r.get("gates") else None),
    ("request_goodput", lambda r: r.get("request_goodput")),
    ("cost (USD)", lambda r: (r.get("cost") or {}).get("dollars")),
]


def compare(results: list[dict[str, Any]], labels: list[str]) -> str:
    """One column per file; after the first, each value carries its ratio to the first file's."""
    rows = []
    for name, get in COMPARE_ROWS:
        base = get(results[0])
        row = [name, fmt(base)]
        for res in results[1:]:
            value = get(res)
            ratio = f" ({value / base:.3g}×)" if isinstance(value, int | float) and base else ""
            row.append(fmt(value) + ratio)
        rows.append(row)
    return "\n".join(_table(["metric", *labels], rows)) + "\n"
