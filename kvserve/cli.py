"""Command line: `kvserve serve | generate | bench ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvserve.config import ATTENTION_BACKENDS, CLI_QUANTIZATION, QUANTIZATIONS, EngineConfig
from kvserve.kernels.cpu import isa as cpu_isa
from kvserve.server.limits import add_server_limit_args, server_limits_from_args
from kvserve.server.routing import POLICIES


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default to its help, unless the help states its default itself (an environment
    variable's value, such as an API key, must never be printed)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine."""
    d = EngineConfig()
    parser.add_argument("--model", default=d.model, help="bundled model name, .gguf path or HF directory")
    parser.add_argument(
        "--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"], help="auto: bf16 where it pays"
    )
    parser.add_argument("--device", default=d.device, help="auto: cuda when present, else cpu")
    parser.add_argument(
        "--quantization", default=CLI_QUANTIZATION, choices=QUANTIZATIONS,
        help="auto: keep GGUF weights in their blocks where kvserve's quantized kernels run; none: dequantize",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    parser.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV pool size in blocks")
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=d.kv_cache_memory_bytes,
        help="KV pool size in bytes, where --num-kv-blocks is not given",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="tokens per forward pass"
    )
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per forward pass")
    parser.add_argument(
        "--max-model-len", type=int, default=d.max_model_len, help="prompt + output tokens (None: the model's context)"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="queue length past which requests are refused (HTTP 429)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn prefix caching off (default: on)",
    )
    parser.add_argument(
        "--no-chunked-prefill",
        dest="enable_chunked_prefill",
        action="store_false",
        help="turn chunked prefill off (default: on)",
    )
    parser.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA; on the CPU auto_cpu (the compiled kernels where they load)",
    )
    parser.add_argument("--speculative", type=json.loads, default=None, help='JSON, e.g. \'{"method": "ngram"}\'')
    parser.add_argument("--seed", type=int, default=d.seed, help="seeds requests that bring no seed")
    parser.add_argument("--num-threads", type=int, default=d.num_threads, help="torch threads (None: torch's default)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{name: getattr(args, name) for name in fields if hasattr(args, name)})


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM
    from kvserve.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    if args.chat:
        prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = llm.tokenizer.encode(args.prompt, add_special_tokens=True)
    (output,) = llm.generate([prompt_ids], params)
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "token_ids": output.token_ids, "text": output.text}))
    else:
        print(output.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.replicas != 1 or args.ray_address is not None:
        return _serve_ray(args)
    from kvserve.server.launch import serve

    limits = server_limits_from_args(args)
    serve(
        engine_config_from_args(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        web_ui=args.web_ui,
        limits=limits,
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.startup_report import engine_report, time_since_start

    engine = LLMEngine(engine_config_from_args(args))
    report = engine_report(engine)
    report.add("time to load", time_since_start())
    print(json.dumps(report.rows, indent=2) if args.json else "\n".join(report.lines()))
    return 0


def _serve_ray(args: argparse.Namespace) -> int:
    # Ray is an optional extra: imported only here, so the single server runs without it.
    try:
        from kvserve.server.ray_app import RayServeConfig, serve_ray
    except ImportError as exc:
        raise ValueError(f"--replicas/--ray-address need Ray Serve ({exc}): pip install 'kvserve[ray]'") from exc
    from kvserve.server.routing import RoutingConfig

    config = engine_config_from_args(args)
    gpus = args.replica_gpus
    if gpus is None:
        import torch

        gpus = 1.0 if config.device in ("auto", "cuda") and torch.cuda.is_available() else 0.0
    ray_config = RayServeConfig(
        num_replicas=args.replicas,
        replica_num_cpus=args.replica_cpus,
        replica_num_gpus=gpus,
        routing=RoutingConfig(policy=args.routing_policy),
        graceful_shutdown_timeout_s=args.drain_timeout,
    )
    serve_ray(config, ray_config, args.ray_address, args.host, args.port, args.api_key, args.served_model_name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    defaults = HelpWithDefaults
    srv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, models, health, metrics)",
        formatter_class=defaults,
    )
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $KVSERVE_API_KEY)",
    )
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    srv.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM"
    )
    srv.add_argument(
        "--no-web-ui",
        dest="web_ui",
        action="store_false",
        help="leave out the web page at / and its live engine view's feed, /v1/engine/events",
    )
    srv.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level",
    )
    srv.add_argument(
        "--replicas", type=int, default=1, help="engine replicas behind one endpoint; more than 1 runs on Ray Serve"
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to run on: 'auto' (the running one), an address, or 'local' (start one); implies Ray",
    )
    srv.add_argument("--routing-policy", default="prefix_affinity", choices=POLICIES, help="how requests pick replicas")
    srv.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per engine replica")
    srv.add_argument(
        "--replica-gpus", type=float, default=None, help="GPUs per engine replica (default: 1 where CUDA is visible)"
    )
    add_server_limit_args(srv.add_argument_group("request limits (single server)"))
    srv.set_defaults(func=_serve)

    info = sub.add_parser(
        "info",
        help="load the engine and print its startup report (model, dtype, kernels, KV pool, limits), then exit",
        formatter_class=defaults,
    )
    add_engine_args(info)
    info.add_argument("--json", action="store_true", help="print the report as a JSON object")
    info.set_defaults(func=_info)

    gen = sub.add_parser("generate", help="generate text for one prompt on the local engine", formatter_class=defaults)
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    gen.add_argument("--json", action="store_true", help="print prompt_ids, token_ids and text as JSON")
    gen.set_defaults(func=_generate)

    from kvserve.bench.cli import register

    bench = sub.add_parser("bench", help="measure: workloads, replay against servers or offline, analyze, plot")
    register(bench.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cpu_isa.cap_torch(cpu_isa.selected())  # a forced path: torch's own ops too, set before they first run
        return args.func(args)
    except (ValueError, OSError) as exc:  # OSError's message names the file (missing, unreadable, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
