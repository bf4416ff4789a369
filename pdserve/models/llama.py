"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) over a paged KV cache (torch).

One flat batch of tokens per step: [T] ids with their positions. q/k/v and gate/up projections are
fused into single matmuls; attention is `paged_attention`. Numerics follow Hugging Face's
implementation (RMSNorm and RoPE tables in float32) so greedy outputs match it token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.errors import ModelLoadError
from pdserve.modelfiles.config import ModelConfig
from pdserve.ops.attention import AttentionMetadata
from pdserve.ops.cpu.linear import PackedLinear, pack_linears
from pdserve.ops.layer_ops import TorchLayerOps


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # Llama 3: low frequencies scaled down by `factor`, high ones kept, a smooth ramp between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]: rotate-half (GPT-NeoX) layout, as HF
        # Plain attributes, not buffers: `model.to(bfloat16)` must not round the tables (HF keeps
        # them float32 and casts the product, as `forward` does).
        self.cos = emb.cos()
        self.sin = emb.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the model dtype, as HF does, then scale in the model dtype.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.intermediate_size = config.intermediate_size

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's output (or the embeddings)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before that output
        positions: torch.Tensor,  # [T]
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchLayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream)
        # HF adds each block's output to the residual and normalizes the sum; the add is done at the
        # next norm (one fused op on CPU), with the same rounding.
        if residual is None:
            residual = hidden
            normed = ops.norm(hidden, self.input_layernorm)
        else:
            normed, residual = ops.add_norm(hidden, residual, self.input_layernorm)
        qkv = self.qkv_proj(normed)  # [T, q_size + 2 * kv_size]
        attn = ops.attention(
            qkv, positions, rope, k_cache, v_cache, meta, self.num_heads, self.num_kv_heads, self.scale
        )  # [T, q_size]
        normed, residual = ops.add_norm(self.o_proj(attn), residual, self.post_attention_layernorm)
        gate_up = self.gate_up_proj(normed)  # [T, 2 * intermediate]
        return self.down_proj(ops.silu_and_mul(gate_up)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, max_positions)
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.packed_logits: PackedLinear | None = None  # [hidden] -> [vocab], repacked (pack_for_cpu)
        # True once pack_for_cpu stored an fp32 model's matrices in bf16 (the fp32 stream GEMV)
        self.weights_in_bf16 = False
        self.ops: TorchLayerOps = TorchLayerOps()  # the per-layer ops (layer_ops.py)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, KVH, D]
        meta: AttentionMetadata,
        between_layers: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`between_layers(n)`: called after each of the first num_layers - 1 layers, with the
        number done. It may run other forward passes (a prefill worker's short prompts between
        two layers of a long chunk): this pass keeps no state outside its locals, and what it
        writes to `kv_cache` lies in its own requests' blocks."""
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(
                hidden, residual, positions, self.rope, kv_cache[i, 0], kv_cache[i, 1], meta, self.ops
            )
            if between_layers is not None and i < last:
                between_layers(i + 1)
        assert residual is not None
        normed, _ = self.ops.add_norm(hidden, residual, self.norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        # In the model dtype: the sampler widens them to float32 only where it needs more than an
        # argmax (an [8, 49152] copy is ~0.2 ms of a decode step).
        if self.packed_logits is not None:
            logits: torch.Tensor = self.packed_logits(hidden)
            return logits
        return F.linear(hidden, self.logits_weight)

    @property
    def logits_weight(self) -> torch.Tensor:  # [vocab, hidden]: lm_head's, or the embedding's if tied
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_for_cpu(
        self, onednn: bool = True, stream_rows: int = 0, logits_stream_rows: int | None = None
    ) -> int:
        """Repack every projection's weight, the logits' too, for oneDNN and/or the stream GEMV of
        steps up to `stream_rows` rows (cpu/linear.py), the logits' up to `logits_stream_rows`
        (None: `stream_rows`; a vocabulary-wide weight gains less from it): after the weights are
        loaded and cast, on CPU. Returns how many layers were packed.

        In float32 a stream stores the weights in bf16: then every matrix of the model is rounded
        to bf16 (the projections by PackedLinear, the embedding table and the logits' weight here,
        whether their stream is used or not), so that the model computes in fp32 with one set of
        rounded weights, whatever the step's width; norms and biases stay fp32."""
        # The logits never take the stream for wider steps than the layers do.
        logits_rows = stream_rows if logits_stream_rows is None else min(stream_rows, logits_stream_rows)
        if stream_rows > 0 and self.embed_tokens.weight.dtype == torch.float32:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(self.embed_tokens.weight.to(torch.bfloat16))
                if self.lm_head is not None:  # untied: rounded too, its own stream used or not
                    self.lm_head.weight.copy_(self.lm_head.weight.to(torch.bfloat16))
            self.weights_in_bf16 = True
        self.packed_logits = PackedLinear(self.logits_weight, None, onednn, logits_rows)
        count = pack_linears(self.layers, onednn, stream_rows)
        return count + 1

    # -- weights ------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up. Checks nothing is missing."""
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {  # HF name suffix -> (our parameter suffix, row offset, rows)
            "self_attn.q_proj": ("qkv_proj", 0, q_size),
            "self_attn.k_proj": ("qkv_proj", q_size, kv_size),
            "self_attn.v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "mlp.gate_proj": ("gate_up_proj", 0, inter),
            "mlp.up_proj": ("gate_up_proj", inter, inter),
        }
        renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}
        params = dict(self.named_parameters())
        pending = set(params)
        pending_rows: dict[str, int] = {}
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            seen.add(name.removeprefix("model."))
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still ship a copy
            target, rows = self._target(name, fused, renamed)
            if target not in params:
                raise ModelLoadError(f"checkpoint has a weight the model does not expect: {name}")
            param = params[target]
            dest = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            if rows is None:
                pending.discard(target)
            else:
                pending_rows[target] = pending_rows.get(target, 0) + rows[1]
                if pending_rows[target] == param.shape[0]:
                    pending.discard(target)
        if pending:
            # Named as in the checkpoint, not as our fused parameters.
            missing = [
                name if name.startswith("lm_head.") else f"model.{name}"
                for target in sorted(pending)
                for name in self._checkpoint_names(target, fused, renamed)
                if name not in seen
            ]
            raise ModelLoadError(f"checkpoint is missing weights: {missing[:8]}")

    @staticmethod
    def _checkpoint_names(
        target: str, fused: dict[str, tuple[str, int, int]], renamed: dict[str, str]
    ) -> list[str]:
        """The Hugging Face names (without `model.`) of the weights that make up parameter `target`."""
        for hf, ours in renamed.items():
            target = target.replace(f".{ours}.", f".{hf}.")
        parts = [
            target.replace(f".{ours}.", f".{hf}.")
            for hf, (ours, _, _) in fused.items()
            if f".{ours}." in target
        ]
        return parts or [target]

    @staticmethod
    def _target(
        name: str, fused: dict[str, tuple[str, int, int]], renamed: dict[str, str]
    ) -> tuple[str, tuple[int, int] | None]:
        if name.startswith("model."):
            name = name[len("model.") :]
        for hf, (ours, offset, rows) in fused.items():
            marker = f".{hf}."
            if marker in name:
                prefix, suffix = name.split(marker)
                return f"{prefix}.{ours}.{suffix}", (offset, rows)
        for hf, ours in renamed.items():
            name = name.replace(f".{hf}.", f".{ours}.")
        return name, None
