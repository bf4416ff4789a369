"""The `pdserve` command line. Heavy modules (torch) are imported only by the subcommand that needs them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from pdserve.errors import PdserveError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt (a quick look at a model)")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument(
        "--model", default="smollm2-135m", help="built-in name, .gguf file or Hugging Face folder"
    )
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--threads", type=int, default=None, help="CPU threads for torch")

    conv = sub.add_parser("convert", help="convert a GGUF file (or built-in name) into a Hugging Face folder")
    conv.add_argument("model", help="built-in name or .gguf file")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    conv.add_argument("--overwrite", action="store_true")

    info = sub.add_parser(
        "info", help="what this machine runs: CPU features, the measured dtype and kernel choices"
    )
    info.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")

    from pdserve import serve
    from pdserve.bench import run as bench
    from pdserve.measure import cli as profile_cli
    from pdserve.pools import cli as pools
    from pdserve.sim import plan
    from pdserve.sim import run as sim

    # The subcommands whose module adds its flags and runs them (each raises PdserveError on bad input).
    commands: dict[str, tuple[Any, str, Callable[[argparse.Namespace], int]]] = {
        "serve": (
            serve,
            "serve a model over an OpenAI-compatible HTTP API (router + workers on this host)",
            lambda args: serve.run(serve.resolve_options(args)),
        ),
        "pools": (
            pools,
            "show, scale, drain and rebalance a running server's pools (its admin API)",
            pools.run,
        ),
        "bench": (
            bench,
            "benchmark an OpenAI-compatible server (TTFT, ITL, TPOT, goodput); "
            "`pdserve bench compare --help`: configurations side by side",
            bench.run,
        ),
        "sim": (
            sim,
            "simulate a deployment (serve's flags) on a workload (bench's) from a profile, in virtual time",
            sim.run,
        ),
        "plan": (
            plan,
            "the pool sizes that meet an SLO at the best goodput per worker, by simulating each candidate",
            plan.run,
        ),
        "profile": (
            profile_cli,
            "measure what a model costs on this machine (or derive it from a roofline), for sim and plan",
            profile_cli.run,
        ),
    }
    for name, (module, help_text, _) in commands.items():
        command_parser = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command_parser)

    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        from pdserve.bench import compare

        compare_parser = argparse.ArgumentParser(
            prog="pdserve bench compare",
            description=compare.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        compare.add_arguments(compare_parser)
        try:
            return compare.run(compare_parser.parse_args(argv[2:]))
        except PdserveError as exc:
            print(f"pdserve: error: {exc}", file=sys.stderr)
            return 2

    args = parser.parse_args(argv)
    if args.command in commands:
        try:
            return commands[args.command][2](args)
        except PdserveError as exc:
            print(f"pdserve: error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "info":
            return _info(args)
        return _convert(args)
    except (PdserveError, ValueError) as exc:  # ValueError: a bad option (--device, --threads)
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


def _info(args: argparse.Namespace) -> int:
    import torch

    from pdserve.ops.cpu import huge_pages
    from pdserve.ops.cpu import isa as cpu_isa
    from pdserve.ops.cpu import plan as cpu_choice
    from pdserve.ops.cpu.kernels import unavailable_reason

    isa_now = cpu_isa.probe()  # raises CpuIsaError (a PdserveError) for a bad PDSERVE_CPU_ISA
    plan = cpu_choice.cpu_plan(refresh=args.refresh)
    kernels = cpu_choice.kernel_isa()
    print(
        f"torch {torch.__version__} (its own dispatch: {torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} threads"
    )
    print(f"CPU: {plan.model}")
    print(f"  ISA: {isa_now.describe()}")
    if isa_now.torch_env:
        knobs = " ".join(f"{key}={os.environ.get(key, '(unset)')}" for key in isa_now.torch_env)
        print(f"    torch capped by: {knobs}")
    print(f"  flags in force: {' '.join(plan.flags) or '(none of ' + ', '.join(cpu_isa.TRACKED_FLAGS) + ')'}")
    print(f"  dtype=auto: {plan.auto_dtype}")
    for dtype, by_rows in plan.gflops.items():
        rates = ", ".join(f"M={rows} {rate:.0f}" for rows, rate in by_rows.items())
        speedups = ", ".join(f"M={rows} {x:.2f}x" for rows, x in plan.prepack_speedup.get(dtype, {}).items())
        chosen = "prepacked oneDNN" if plan.prepack.get(dtype) else "torch F.linear"
        print(f"  {dtype}: matmul GFLOP/s {rates}; prepacked weights {speedups or 'unavailable'} -> {chosen}")
        if dtype in plan.stream_speedup:
            stream = ", ".join(f"M={rows} {x:.2f}x" for rows, x in plan.stream_speedup[dtype].items())
            rows = plan.stream_rows.get(dtype, 0)
            stored = " (weights stored in bf16)" if dtype == "float32" else ""
            print(
                f"    stream GEMV{stored} against it: {stream} -> "
                + (f"used for steps of up to {rows} rows" if rows else "not used")
            )
            if dtype in plan.logits_stream_speedup:
                logits = ", ".join(f"M={r} {x:.2f}x" for r, x in plan.logits_stream_speedup[dtype].items())
                used = min(rows, plan.logits_stream_rows.get(dtype, 0))
                print(
                    f"    on the logits' weight: {logits} -> "
                    + (f"used for steps of up to {used} rows" if used else "not used")
                )
    for what, why in plan.unavailable.items():
        print(f"  {what}: unavailable — {why}")
    built = f"{kernels} ({' '.join(isa_now.march)})" if kernels else f"unavailable: {unavailable_reason()}"
    print(f"  C++ kernels: {built}")
    private, shared = huge_pages.thp_setting(), huge_pages.thp_setting(huge_pages.THP_SHMEM_ENABLED)
    print(
        f"  KV cache pages: transparent_hugepage={private} (a private cache: "
        f"{'2 MiB' if huge_pages.wanted() and huge_pages.huge_pages_possible(private) else '4 KiB'}), "
        f"shmem_enabled={shared} (an shm transport's cache: "
        f"{'2 MiB' if huge_pages.huge_pages_possible(shared) else '4 KiB'})"
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(plan.measured_at))
    print(f"  measured {when}, cached in {cpu_choice.cache_path()}")
    if torch.cuda.is_available():
        print(f"CUDA: {torch.cuda.get_device_name()} (dtype=auto: bfloat16 where supported, else float16)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.device != "auto":
        import torch

        try:
            torch.device(args.device)
        except RuntimeError as exc:  # torch's message lists the device types it knows
            raise ValueError(f"bad --device {args.device!r}: {exc}") from None
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, threads=args.threads)
    loaded = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    finished = time.perf_counter()
    for prompt, output in zip(args.prompt, outputs, strict=True):
        completion = output.outputs[0]
        print(f"--- {prompt!r}")
        print(completion.text)
        print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"[model {args.model}: {llm.engine.runner.dtype} on {llm.engine.runner.device}, loaded in {loaded - started:.1f} s; "
        f"{tokens} tokens in {finished - loaded:.2f} s]",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.models.gguf_convert import convert_gguf_to_hf
    from pdserve.models.loader import resolve_model

    source = resolve_model(args.model)
    if source.kind != "gguf":
        print(f"pdserve: error: {args.model} is already a Hugging Face folder", file=sys.stderr)
        return 2
    out = convert_gguf_to_hf(source.path, Path(args.out_dir), dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
