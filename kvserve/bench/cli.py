"""`kvserve bench ...` subcommands. ``register`` adds them to the bench sub-parser group; each
handler takes the parsed args and returns an exit code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvserve.bench import generators, report, workload
from kvserve.bench.metrics import Gates
from kvserve.bench.records import RequestRecord, load_schedule_csv
from kvserve.bench.results import build_results, load_results, records_of, save_results

DEFAULT_MODEL = "smollm2-135m-instruct"


def _generator_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("generated workload (when no --workload is given)")
    g.add_argument("--kind", choices=["random", "shared-prefix", "copy"], default="random")
    g.add_argument("-n", "--num-requests", type=int, default=100, help="random and copy workloads")
    g.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    g.add_argument("--cv", type=float, default=1.0, help="inter-arrival CV: 1 Poisson, >1 bursty")
    g.add_argument("--input-len", default="128", help="N, uniform:LO:HI or normal:MEAN:STD")
    g.add_argument("--output-len", default="128", help="N, uniform:LO:HI or normal:MEAN:STD")
    g.add_argument("--num-docs", type=int, default=4, help="shared-prefix: documents")
    g.add_argument("--questions-per-doc", type=int, default=8, help="shared-prefix: questions each")
    g.add_argument("--tenants", type=int, default=1, help="shared-prefix: tenants (one cache_salt each)")
    g.add_argument("--doc-words", type=int, default=300, help="shared-prefix: words per document")
    g.add_argument("--passage-words", type=int, default=60, help="copy: words per passage")
    g.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths, texts and token ids")
    return p


def _report_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("window, cost, gates and output")
    g.add_argument("--window-ms", type=float, help="fixed window length (default: drain window only)")
    g.add_argument("--window-start-ms", type=float, help="fixed window start (default: first arrival)")
    g.add_argument("--price-per-hour", type=float, help="resource price, USD/h, charged over the window")
    g.add_argument("--ttft-gate-ms", type=float, help="hard TTFT bound (violations reported)")
    g.add_argument("--tpot-gate-ms", type=float, help="hard TPOT bound (violations reported)")
    g.add_argument("--out", type=Path, help="results JSON (a markdown report is written beside it)")
    return p


def _run_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("replay")
    g.add_argument("--workload", type=Path, help="JSONL workload (else one is generated)")
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--warmup", type=int, default=1, help="requests before time 0, excluded")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force ignore_eos on (or off) for every request (default: each request's own)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def workload_from_args(args: argparse.Namespace) -> list[workload.WorkloadRequest]:
    if getattr(args, "workload", None):
        return workload.load(args.workload)
    out_len = generators.LengthDist.parse(args.output_len)
    if args.kind == "shared-prefix":
        return generators.shared_prefix_workload(
            args.num_docs,
            args.questions_per_doc,
            args.rate,
            out_len,
            num_tenants=args.tenants,
            doc_words=args.doc_words,
            cv=args.cv,
            seed=args.seed,
        )
    if args.kind == "copy":
        return generators.copy_workload(args.num_requests, args.rate, args.passage_words, args.cv, args.seed)
    in_len = generators.LengthDist.parse(args.input_len)
    return generators.random_workload(args.num_requests, args.rate, in_len, out_len, args.cv, args.seed)


def _emit(records: list[RequestRecord], meta: dict[str, Any], args: argparse.Namespace) -> int:
    """Summarize, print the markdown report, and write JSON + markdown when --out is given."""
    gates = Gates(ttft_ms=args.ttft_gate_ms, tpot_ms=args.tpot_gate_ms)
    res = build_results(records, meta, args.window_ms, args.window_start_ms, gates, args.price_per_hour)
    text = report.markdown(res, title=f"kvserve bench {args.bench_command}")
    print(text)
    if args.out:
        save_results(res, args.out)
        args.out.with_suffix(".md").write_text(text)
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


def cmd_make_workload(args: argparse.Namespace) -> int:
    requests = workload_from_args(args)
    workload.save(requests, args.out)
    print(f"wrote {len(requests)} requests to {args.out}")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    if args.schedule.suffix == ".json":  # re-analyze a results file with another window/gate/price
        old = load_results(args.schedule)
        records, meta = records_of(old), {**old.get("meta", {}), "reanalyzed_from": str(args.schedule)}
    else:
        records = load_schedule_csv(args.schedule)
        meta = {"source": f"given schedule {args.schedule}", "token_counting": "one emission per listed time"}
    return _emit(records, meta, args)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.bench.replay import ReplayConfig, replay

    cfg = ReplayConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        quiet=args.quiet,
        extra_body=json.loads(args.extra_body),
    )
    requests = workload_from_args(args)
    records, meta = replay(requests, cfg)
    return _emit(records, {**meta, "workload": str(args.workload or f"generated ({args.kind})")}, args)


def cmd_offline(args: argparse.Namespace) -> int:
    from kvserve.bench.offline import OfflineConfig, replay_offline

    cfg = OfflineConfig(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        warmup=args.warmup,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        quiet=args.quiet,
        chat=args.endpoint == "chat",
    )
    records, meta = replay_offline(workload_from_args(args), cfg)
    return _emit(records, {**meta, "workload": str(args.workload or f"generated ({args.kind})")}, args)


def _labels(args: argparse.Namespace) -> list[str]:
    labels = args.labels.split(",") if args.labels else [p.stem for p in args.results]
    if len(labels) != len(args.results):
        raise SystemExit(f"--labels has {len(labels)} names for {len(args.results)} files")
    return labels


def cmd_plot(args: argparse.Namespace) -> int:
    from kvserve.bench.plot import plot_cdfs, plot_timeline

    results = [load_results(p) for p in args.results]
    prefix = args.out_prefix or args.results[0].with_suffix("")
    timeline, cdf = Path(f"{prefix}-timeline.png"), Path(f"{prefix}-cdf.png")
    plot_timeline(results, _labels(args), timeline)
    plot_cdfs(results, _labels(args), cdf)
    print(f"wrote {timeline} and {cdf}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    text = report.compare([load_results(p) for p in args.results], _labels(args))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def register(subparsers: Any) -> None:
    """Add the bench subcommands to ``subparsers`` (an argparse sub-parser group)."""
    gen, rep, run = _generator_options(), _report_options(), _run_options()

    p = subparsers.add_parser("make-workload", parents=[gen], help="write a generated JSONL workload")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_make_workload)

    p = subparsers.add_parser(
        "analyze", parents=[rep], help="metrics of a given schedule CSV (or re-analyze a results JSON)"
    )
    p.add_argument("schedule", type=Path, help="CSV: request,arrival_ms,input_tokens,output_tokens,emissions_ms")
    p.set_defaults(func=cmd_analyze)

    help_ = "replay against an OpenAI-compatible server"
    p = subparsers.add_parser("serve", parents=[run, gen, rep], help=help_)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: unlimited)")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("offline", parents=[run, gen, rep], help="replay through the in-process engine")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="chat: apply the chat template"
    )
    p.add_argument("--max-num-seqs", type=int, help="1 = serial; default: the engine's")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=cmd_offline)

    p = subparsers.add_parser("plot", help="timeline (like Figure 31.1) and TTFT/TPOT CDFs as PNG")
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--labels", help="comma-separated panel names (default: file names)")
    p.add_argument("--out-prefix", help="writes PREFIX-timeline.png and PREFIX-cdf.png")
    p.set_defaults(func=cmd_plot)

    p = subparsers.add_parser("compare", help="side-by-side table with ratios to the first file")
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--labels", help="comma-separated column names (default: file names)")
    p.add_argument("--out", type=Path, help="also write the table here")
    p.set_defaults(func=cmd_compare)
