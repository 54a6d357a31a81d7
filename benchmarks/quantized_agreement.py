"""How closely engines serving a GGUF's own blocks follow the same file dequantized to float32.

The reference is kvserve's dequantized float32 engine (`--quantization none`), greedy on 16 prompts x 64
tokens. Each engine beside it is measured with kvserve/bench/agreement.py's two figures: free-running
(each generates on its own) and teacher-forced (at each position it sees the reference's output so far;
one single-token request per position). The engines: kvserve on native blocks (`--quantization auto`)
in float32 and bfloat16, and, given its URL, llama.cpp's server on the same file, which multiplies
activations quantized to 8 bits (its own choice of precision, measured here on the same footing).

    llama-server -m FILE.gguf --port 18314 -t 2 -c 8192 &     # optional peer
    python benchmarks/quantized_agreement.py [--model gemma3-270m] [--llamacpp-url http://127.0.0.1:18314]

Prompts go to llama.cpp as token ids (no BOS is added to an id prompt), so both engines see the same ids.
A model without a chat template (a base model) gets the prompts as raw text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
from dtype_agreement import conversations, print_table

from kvserve import LLM, SamplingParams
from kvserve.bench.agreement import forced_contexts, free_running, greedy_agreement, share_matching
from kvserve.model.registry import DEFAULT_MODEL


def prompt_ids(llm: LLM, count: int) -> list[list[int]]:
    """dtype_agreement's chat prompts; their text alone for a model without a chat template."""
    chats = conversations(count)
    if llm.tokenizer.chat_template is None:
        return [llm.tokenizer.encode(chat[0]["content"], add_special_tokens=True) for chat in chats]
    return [llm.tokenizer.encode_chat(chat) for chat in chats]


def llamacpp_tokens(client: httpx.Client, prompt: list[int], count: int) -> list[int]:
    """llama.cpp's greedy continuation of an id prompt (temperature 0 samples the argmax)."""
    body = {"prompt": prompt, "n_predict": count, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    response = client.post("/completion", json=body)
    response.raise_for_status()
    tokens = response.json()["tokens"]
    if len(tokens) != count:
        raise RuntimeError(f"llama.cpp returned {len(tokens)} tokens, asked for {count}")
    return tokens


def llamacpp_row(url: str, prompts: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    with httpx.Client(base_url=url, timeout=120) as client:
        outputs = [llamacpp_tokens(client, p, len(reference[0])) for p in prompts]
        forced = [llamacpp_tokens(client, context, 1)[0] for context in forced_contexts(prompts, reference)]
    return {**free_running(reference, outputs), "teacher_forced_token_agreement": share_matching(forced, reference)}


def measure(model: str, num_prompts: int, output_len: int, llamacpp_url: str | None) -> dict[str, dict[str, float]]:
    dense = LLM(model, dtype="float32", quantization="none")
    prompts = prompt_ids(dense, num_prompts)
    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    reference = [list(o.token_ids) for o in dense.generate(prompts, greedy)]
    del dense
    results = {
        f"kvserve auto {d}": greedy_agreement(LLM(model, dtype=d, quantization="auto"), prompts, reference)
        for d in ("float32", "bfloat16")
    }
    if llamacpp_url:
        results["llama.cpp server"] = llamacpp_row(llamacpp_url, prompts, reference)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--llamacpp-url", help="a llama.cpp server already serving the same GGUF file")
    parser.add_argument("--out", default="benchmarks/results/quantized_agreement.json")
    args = parser.parse_args()
    results = measure(args.model, args.prompts, args.output_len, args.llamacpp_url)
    shape = f"{args.prompts} prompts x {args.output_len} tokens"
    print_table(results, f"{args.model}: native blocks vs the file dequantized to float32, {shape}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
