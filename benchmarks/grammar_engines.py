"""Which grammar engine kvserve uses: token-mask time per decode step, llguidance vs xgrammar.

Both engines walk the same JSON answer (a valid instance of SCHEMA, tokenized with the bundled
SmolLM2 tokenizer, 49,152 tokens) one token at a time; each step computes the mask of every row of a
batch of B matchers in the same state, then feeds them the token. Reported: compile time and mean
mask time per step at B = 1 and B = 32. xgrammar is optional (it pulls triton; install it apart, e.g.
`pip install --target /tmp/xgr --no-deps xgrammar apache-tvm-ffi` and PYTHONPATH=/tmp/xgr).

    python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import time

import torch

from kvserve.model.registry import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@math.uk",
    "tags": ["a", "c"],
    "address": {"city": "London", "zip": "12345"},
}


def measure_llguidance(tokenizer, answer_ids: list[int], batch: int) -> tuple[float, float]:
    import llguidance
    import llguidance.torch as llt

    lltok = llguidance.LLTokenizer(
        tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.stop_token_ids
    )
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - start
    executor = llguidance.LLExecutor()
    mask = llt.allocate_token_bitmask(batch, tokenizer.vocab_size)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    total = 0.0
    for token in answer_ids:
        start = time.perf_counter()
        if batch == 1:
            llt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            llt.fill_next_token_bitmask_par(executor, pairs, mask)
        total += time.perf_counter() - start
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    return compile_s, total / len(answer_ids)


def measure_xgrammar(tokenizer, answer_ids: list[int], batch: int) -> tuple[float, float]:
    import xgrammar as xgr

    vocab = [tokenizer._tok.id_to_token(i) for i in range(tokenizer.vocab_size)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, stop_token_ids=tokenizer.stop_token_ids)
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":"))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    compile_s = time.perf_counter() - start
    mask = xgr.allocate_token_bitmask(batch, tokenizer.vocab_size)
    batched = xgr.BatchGrammarMatcher() if batch > 1 else None
    total = 0.0
    for token in answer_ids:
        start = time.perf_counter()
        if batched is None:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            batched.batch_fill_next_token_bitmask(matchers, mask)
        total += time.perf_counter() - start
        for m in matchers:
            assert m.accept_token(token)
    return compile_s, total / len(answer_ids)


def main() -> None:
    tokenizer = load_model("smollm2-135m-instruct").tokenizer
    answer_ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")))
    print(f"vocabulary {tokenizer.vocab_size}, answer {len(answer_ids)} tokens, {torch.get_num_threads()} threads")
    print(f"{'engine':<12} {'batch':>5} {'compile ms':>11} {'mask ms/step':>13}")
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        for batch in (1, 32):
            try:
                compile_s, step_s = measure(tokenizer, answer_ids, batch)
            except ImportError as exc:
                print(f"{name:<12} not installed ({exc})")
                break
            print(f"{name:<12} {batch:>5} {compile_s * 1e3:>11.1f} {step_s * 1e3:>13.3f}")


if __name__ == "__main__":
    main()
