"""model/decode_cost.py: the bytes a decode step reads and the FLOPs a token computes, against sums done by
hand over a tiny two-layer model whose every tensor size is known: dense bf16 with an untied LM head, and
Q8_0 blocks (34 bytes per 32 weights) with the LM head tied to the embedding table."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from kvserve.model.config import FULL, SLIDING, ModelConfig
from kvserve.model.decode_cost import DecodeCost
from kvserve.model.quantized import QuantizedTensor
from kvserve.model.weights import LayerWeights, ModelWeights

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 8, 32, 64, 2, 1, 16
QKV_ROWS = (HEADS + 2 * KV_HEADS) * HEAD_DIM  # 64
# Each layer's four projections as (rows, columns).
PROJECTIONS = [(QKV_ROWS, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
Q8_0_BLOCK_BYTES = 34  # 32 int8 values and one f16 scale


def config(layer_types: tuple[str, ...] = (FULL, FULL), window: int | None = None) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_layers=2, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        layer_types=layer_types, sliding_window=window,
    )  # fmt: skip


def q8_0(rows: int, cols: int) -> QuantizedTensor:
    blocks = torch.zeros(rows, cols // 32 * Q8_0_BLOCK_BYTES, dtype=torch.uint8)
    return QuantizedTensor(blocks, GGMLQuantizationType.Q8_0, (rows, cols))


def weights(quantized: bool) -> ModelWeights:
    def matrix(rows: int, cols: int) -> torch.Tensor | QuantizedTensor:
        return q8_0(rows, cols) if quantized else torch.zeros(rows, cols, dtype=torch.bfloat16)

    def layer() -> LayerWeights:
        norm = torch.zeros(HIDDEN, dtype=torch.bfloat16)
        qkv, o, gate_up, down = (matrix(*shape) for shape in PROJECTIONS)
        return LayerWeights(norm, qkv, o, norm.clone(), gate_up, down)

    table = matrix(VOCAB, HIDDEN)
    head = table if quantized else matrix(VOCAB, HIDDEN)
    return ModelWeights(table, [layer(), layer()], torch.zeros(HIDDEN, dtype=torch.bfloat16), head)


def test_dense_weights_count_every_layer_tensor_the_final_norm_and_the_head_at_two_bytes_each() -> None:
    cost = DecodeCost.of(weights(quantized=False), config(), torch.bfloat16)
    per_layer = 2 * HIDDEN + sum(rows * cols for rows, cols in PROJECTIONS)  # two norms and four projections
    assert cost.weight_bytes == 2 * (2 * per_layer + HIDDEN + VOCAB * HIDDEN)
    assert cost.embedding_row_bytes == 2 * HIDDEN
    assert cost.kv_token_bytes == 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    # One sequence at 5 tokens: the weights, its token's embedding row, 5 keys and values in each layer.
    assert cost.step_bytes([5]) == cost.weight_bytes + 2 * HIDDEN + 2 * 5 * cost.kv_token_bytes
    # Three sequences: the weights still once, three rows, each sequence's own keys.
    assert cost.step_bytes([5, 1, 9]) == cost.weight_bytes + 3 * 2 * HIDDEN + 2 * 15 * cost.kv_token_bytes


def test_quantized_weights_count_their_blocks_and_a_tied_head_once() -> None:
    cost = DecodeCost.of(weights(quantized=True), config(), torch.float32)
    blocks = sum(rows * cols // 32 * Q8_0_BLOCK_BYTES for rows, cols in PROJECTIONS)
    head = VOCAB * HIDDEN // 32 * Q8_0_BLOCK_BYTES  # the embedding table, read whole as the LM head
    assert cost.weight_bytes == 2 * (2 * 2 * HIDDEN + blocks) + 2 * HIDDEN + head  # norms stay bf16 here
    assert cost.embedding_row_bytes == HIDDEN // 32 * Q8_0_BLOCK_BYTES
    assert cost.kv_token_bytes == 2 * KV_HEADS * HEAD_DIM * 4  # a float32 cache


def test_a_sliding_layer_reads_and_attends_to_at_most_its_window() -> None:
    cost = DecodeCost.of(weights(quantized=False), config((SLIDING, FULL), window=3), torch.bfloat16)
    assert cost.attended_keys(2) == 2 + 2
    assert cost.attended_keys(10) == 3 + 10
    assert cost.step_bytes([10]) == cost.weight_bytes + 2 * HIDDEN + 13 * cost.kv_token_bytes


def test_token_flops_are_two_per_weight_multiplied_plus_attention() -> None:
    cost = DecodeCost.of(weights(quantized=True), config(), torch.bfloat16)
    projections = 2 * sum(rows * cols for rows, cols in PROJECTIONS)  # two layers
    head = VOCAB * HIDDEN
    attention_per_key = 2 * 2 * HEADS * HEAD_DIM  # q.k and p.v
    assert cost.token_flops(7) == 2 * projections + 2 * head + attention_per_key * 2 * 7
    assert cost.token_flops(7, lm_head=False) == 2 * projections + attention_per_key * 2 * 7
