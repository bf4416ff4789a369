"""Engine throughput on a GPU: pdserve against transformers' own `generate`, in one run.

The model has random weights in the shape of SmolLM2-135M (`--shape smollm2-135m`, the default) or
Llama 3.2 1B (`--shape llama-1b`), built with transformers and saved as a Hugging Face folder
(safetensors) at start: the real SmolLM2 GGUF need not be on the GPU machine, and throughput does
not depend on the weights' values (greedy with `ignore_eos`: every request runs the same number of
steps whatever tokens come out).

Measured per engine, each in its own process, timed the same way from outside through its offline
`generate` (greedy, `ignore_eos`), as benchmarks/engine.py does on CPU:
- prefill tokens/s: one `--prefill-len` (2048) token prompt, over the time to its first token; and
  at each batch B, B prompts of `--prompt-len` (512) tokens, B * 512 over the time to the first token
  of all of them;
- decode tokens/s at each batch B (1, 8, 32, 128): (time for N tokens - time for 1) over the N - 1
  later tokens of each request, N = `--decode-tokens`.
`pdserve-eager` is pdserve with `cuda_graphs=False` (every step launched op by op): what the
decode steps' CUDA graphs (pdserve/engine/decode_graphs.py) save, in the same run.
Each worker runs every measurement `--repeats` times (each shape after a warm-up call) and reports
the medians; ratios are against transformers measured in the same run.

    python3 benchmarks/engine_gpu.py                       # on the GPU: SmolLM2-135M shape, bf16
    python3 benchmarks/engine_gpu.py --shape llama-1b
    .venv/bin/python benchmarks/engine_gpu.py --device cpu --shape tiny --dtype float32 \\
        --batches 1,4 --prefill-len 64 --prompt-len 32 --decode-tokens 4 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Hugging Face config fields of each shape (random weights). SmolLM2-135M's are those of the
# built-in GGUF (`pdserve.models.loader.resolve_model("smollm2-135m").hf_config`).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(  # Llama 3.2 1B
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # for a smoke test of this script
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def measure(
    generate: Callable[[list[list[int]], int], float], vocab: int, args: argparse.Namespace
) -> dict[str, float]:
    """One pass over every shape. `generate(prompts, new_tokens)` returns seconds, GPU work included."""
    results: dict[str, float] = {}
    prompt = random_prompts(1, args.prefill_len, vocab, seed=0)
    generate(prompt, 1)  # warm-up: allocator growth, kernel selection for this shape
    results["prefill_tps"] = args.prefill_len / generate(prompt, 1)
    n = args.decode_tokens
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, vocab, seed=batch)
        generate(prompts, 2)  # warm-up with the very shapes measured next
        first = generate(prompts, 1)
        total = generate(prompts, n)
        results[f"prefill_tps_b{batch}"] = batch * args.prompt_len / first
        results[f"decode_tps_b{batch}"] = batch * (n - 1) / (total - first)
    return results


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- workers: each runs in its own process and prints one JSON line -------------------------------
def worker_pdserve(
    args: argparse.Namespace, cuda_graphs: bool = True, attention_backend: str = "auto"
) -> Callable[[list[list[int]], int], float]:
    from pdserve import LLM, SamplingParams

    options: dict[str, Any] = {"cuda_graphs": cuda_graphs, "attention_backend": attention_backend}
    if args.chunk_size:
        options["chunk_size"] = args.chunk_size
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    # Room for the largest batch at once (the default of 64 would run 128 requests in two waves).
    llm = LLM(
        args.folder,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch_sizes),
        kv_cache_memory_gib=args.kv_cache_gib,
        prefix_cache=False,  # the same prompts run twice (prefill, then decode): compute both times
        **options,
    )

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        synchronize(args.device)
        started = time.perf_counter()
        llm.generate(prompts, params)
        synchronize(args.device)
        return time.perf_counter() - started

    return generate


def worker_hf(args: argparse.Namespace) -> Callable[[list[list[int]], int], float]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).to(args.device)
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early, like ignore_eos

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        synchronize(args.device)
        started = time.perf_counter()
        ids = torch.tensor(prompts, device=args.device)  # the host-to-device copy is counted, as in pdserve
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        synchronize(args.device)
        return time.perf_counter() - started

    return generate


def worker_pdserve_eager(args: argparse.Namespace) -> Callable[[list[list[int]], int], float]:
    """pdserve with every step launched op by op (no CUDA graphs): what the graphs save."""
    return worker_pdserve(args, cuda_graphs=False)


def worker_pdserve_triton(args: argparse.Namespace) -> Callable[[list[list[int]], int], float]:
    """pdserve with the step's attention in the Triton paged kernel (ops/cuda/; steps eager)."""
    return worker_pdserve(args, cuda_graphs=False, attention_backend="triton")


WORKERS = {
    "pdserve": worker_pdserve,
    "pdserve-eager": worker_pdserve_eager,
    "pdserve-triton": worker_pdserve_triton,
    "hf": worker_hf,
}


def run_worker_here(args: argparse.Namespace) -> dict[str, Any]:
    vocab = int(json.loads((Path(args.folder) / "config.json").read_text())["vocab_size"])
    generate = WORKERS[args.worker](args)
    runs = [measure(generate, vocab, args) for _ in range(args.repeats)]
    return {
        "median": {m: statistics.median(r[m] for r in runs) for m in runs[0]},
        "runs": runs,
    }


# -- the model folder --------------------------------------------------------------------------------
def make_model_folder(folder: Path, shape: str, device: str) -> None:
    """Random weights of the given shape (bf16 safetensors) and a byte-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    # pdserve loads a tokenizer with every model; token-id prompts never use it.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    fast_tokenizer: Any = PreTrainedTokenizerFast
    fast_tokenizer(tokenizer_object=tok, eos_token="</s>").save_pretrained(folder)

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, where a 1B model takes a while on CPU
        model: Any = LlamaForCausalLM(config)
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def environment(device: str) -> dict[str, str]:
    import torch
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


# -- the driver ------------------------------------------------------------------------------------
def run_worker(engine: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", engine, "--folder", str(folder)]
    for name in (
        "device",
        "dtype",
        "batches",
        "prefill_len",
        "prompt_len",
        "decode_tokens",
        "repeats",
        "kv_cache_gib",
        "chunk_size",
        "max_num_batched_tokens",
    ):
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(f"{engine} worker failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["seconds"] = time.perf_counter() - started
    return result


def print_tables(
    table: dict[str, dict[str, Any]], batches: list[int], prefill_len: int, prompt_len: int
) -> None:
    def cell(engine: str, metric: str) -> str:
        value = table[engine]["median"][metric]
        text = f"{value:,.0f}"
        ref = table.get("hf", {}).get("median", {}).get(metric)
        if engine.startswith("pdserve") and ref:
            text += f" ({value / ref:.2f}× hf)"
        return text

    names = {
        "pdserve": "pdserve",
        "pdserve-eager": "pdserve, no CUDA graphs",
        "pdserve-triton": "pdserve, Triton attention (eager)",
        "hf": "transformers `generate`",
    }
    print("\nDecode tokens/s (medians):\n")
    print("| engine | " + " | ".join(f"b{b}" for b in batches) + " |")
    print("|---" * (len(batches) + 1) + "|")
    for engine in table:
        print(f"| {names[engine]} | " + " | ".join(cell(engine, f"decode_tps_b{b}") for b in batches) + " |")
    print(
        f"\nPrefill tokens/s (medians): one {prefill_len}-token prompt; B prompts of {prompt_len} tokens:\n"
    )
    print(f"| engine | 1 × {prefill_len} | " + " | ".join(f"{b} × {prompt_len}" for b in batches) + " |")
    print("|---" * (len(batches) + 2) + "|")
    for engine in table:
        cells = [cell(engine, "prefill_tps")] + [cell(engine, f"prefill_tps_b{b}") for b in batches]
        print(f"| {names[engine]} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--engines", default="pdserve,pdserve-eager,pdserve-triton,hf")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="pdserve's KV cache")
    parser.add_argument("--chunk-size", type=int, default=None, help="pdserve's; default: the engine's")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="pdserve's; default: the engine's"
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per worker process")
    parser.add_argument("--folder", default=None, help="model folder (made if it has no config.json)")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batches.split(",")]

    if args.worker:
        print("RESULT " + json.dumps(run_worker_here(args)), flush=True)
        return 0

    folder = Path(args.folder or Path(tempfile.gettempdir()) / f"pdserve-bench-random-{args.shape}")
    if not (folder / "config.json").exists():
        started = time.perf_counter()
        make_model_folder(folder, args.shape, args.device)
        print(
            f"made {folder} ({args.shape}, random bf16 weights) in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    info = environment(args.device)
    print(json.dumps({"shape": args.shape, "device": args.device, "dtype": args.dtype, **info}), flush=True)

    table: dict[str, dict[str, Any]] = {}
    for engine in args.engines.split(","):
        try:
            table[engine] = run_worker(engine, args, folder)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"[{engine}] failed: {exc}", file=sys.stderr, flush=True)
            continue
        medians = {m: round(v, 1) for m, v in table[engine]["median"].items()}
        print(f"{engine} ({table[engine]['seconds']:.0f} s): {json.dumps(medians)}", flush=True)

    if table:
        print_tables(table, args.batch_sizes, args.prefill_len, args.prompt_len)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "environment": info, "results": table}, indent=2)
        )
    return 0 if len(table) == len(args.engines.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
