"""Shared fixtures: tiny random Hugging Face models (Llama with GQA, Qwen2 with qkv bias, tied and
untied) written to disk with an offline byte-level tokenizer, so tests load them through exactly
the path users take."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without a GPU, Triton kernels run in its interpreter (tests/test_triton_attention.py). Triton reads
# this when it is first imported, which any test may cause (torch imports it lazily): set it first.
# No NVIDIA driver files: no GPU, known without importing torch.
if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/proc/driver/nvidia/gpus").is_dir():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

TINY_MODELS = {
    # name: (model_type, extra config)
    "llama-gqa-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-gqa-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": False}),
    "llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}


def make_tokenizer():  # type: ignore[no-untyped-def]
    """Byte-level tokenizer: 256 byte tokens + <s>, </s>, <pad>. No training, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(out: Path, model_type: str, extra: dict, seed: int = 0) -> Path:  # type: ignore[type-arg]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(out)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Larger than HF's 0.02 so logits are well separated: greedy ties between two correct
        # implementations would otherwise make the comparison flaky.
        initializer_range=0.15,
    )
    common.update(extra)
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, mt, extra) for name, (mt, extra) in TINY_MODELS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-untied"]


@pytest.fixture(scope="session")
def tiny_llama_4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 4096-token context: streams long enough to outlast a worker's start."""
    out = tmp_path_factory.mktemp("tiny-4k") / "llama-4k"
    return make_tiny_model(out, "llama", {"tie_word_embeddings": False, "max_position_embeddings": 4096})


def load_hf_reference(path: Path, weights_in_bf16: bool):  # type: ignore[no-untyped-def]
    """transformers' model of `path` in fp32, as the engine computes it: where the engine stores an
    fp32 model's matrices in bf16 (the AVX2 stream GEMV, cpu/linear.py), every matrix (2-D weight:
    projections, embedding, lm_head) rounded to bf16 the same way; norms and biases kept."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if weights_in_bf16:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    param.copy_(param.to(torch.bfloat16))
    return model
