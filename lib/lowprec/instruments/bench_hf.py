"""`lowprec bench hf`: training throughput of a small Llama-style `transformers` model with SDPA against our
kernel through the plug-in (lowprec.hf), Fix off and on.

    lowprec bench hf --out results/attention/hf-llama.json      # one H200
    lowprec bench hf --smoke                                    # CPU (Triton interpreter), seconds
    lowprec bench hf --profile ...                              # + each implementation's ops in one step
    lowprec bench hf --compile max-autotune-no-cudagraphs ...   # the models under torch.compile
    lowprec bench hf --impls sdpa,lowprec ...                   # some implementations only (sdpa always)

Training steps, eager or compiled (bf16 autocast, AdamW, random tokens), of one randomly initialised model
per attention implementation, in interleaved rounds. The model (`LLAMA`: grouped-query attention, RoPE) and
the record's keys: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lowprec import hf
from lowprec.checks import comma_list
from lowprec.instruments.bench_overhead import (
    COMPILE_MODES,
    first_step,
    op_lines,
    op_profile,
    time_steps,
    under_compile,
)

LLAMA = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
IMPLS = {"sdpa": None, "lowprec": "triton/precision=fa2", "lowprec+fix": "triton/precision=fa2/fix=2"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per implementation")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (Triton interpreter)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default=None, metavar="MODE",
                        help="the models under torch.compile(mode=MODE) (on the CPU: the aot_eager backend): "
                             + ", ".join(COMPILE_MODES))
    parser.add_argument("--impls", type=comma_list(tuple(IMPLS)), default=tuple(IMPLS),
                        help="the implementations to time, sdpa among them (default: all: "
                             + ",".join(IMPLS) + ")")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each implementation (torch.profiler: the ops that "
                             "take the most device time, or host time on a CPU)")


def llama_step(attn: str, config: dict, batch: int, seq: int, device: str, compile_mode: str | None = None
               ) -> tuple[Callable[[], None], int]:
    """One training step of a Llama of `config` with attn_implementation `attn` (bf16 autocast, AdamW fused on
    a GPU, random tokens), eager or under torch.compile(mode=`compile_mode`), and its parameter count."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config),
                                                          attn_implementation=attn).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    forward = under_compile(model, device, compile_mode)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(config["vocab_size"], (batch, seq), device=device, generator=gen)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def run(args: argparse.Namespace) -> int:
    from lowprec.runs import provenance, write_json

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise ValueError("no CUDA device; use --smoke for a CPU code-path check")
    if min(args.seq, args.batch, args.steps, args.rounds) < 1:
        raise ValueError("--seq, --batch, --steps and --rounds must be >= 1")
    config = TINY if args.smoke else LLAMA
    if args.smoke:
        args.seq, args.batch, args.steps, args.rounds = 32, 2, 1, 1
    if "sdpa" not in args.impls:
        raise ValueError(f"--impls must include sdpa (the reference), got {','.join(args.impls)}")
    if args.seq > config["max_position_embeddings"]:
        raise ValueError(f"--seq must be <= {config['max_position_embeddings']}, got {args.seq}")
    record = {"provenance": {**provenance(), "transformers": importlib.metadata.version("transformers")},
              "args": vars(args), "device": device, "model": config,
              "impls": {name: IMPLS[name] for name in args.impls}, "complete": False}

    def save() -> None:  # after each phase: an interrupted run keeps what it measured ("complete": false)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.out, record)

    start = time.perf_counter()
    steps, record["first_step_s"] = {}, {}
    for name, spec in record["impls"].items():
        if spec is not None:
            hf.register(f"lowprec-bench-{name}", spec)
        steps[name], record["parameters"] = llama_step(
            "sdpa" if spec is None else f"lowprec-bench-{name}", config, args.batch, args.seq, device,
            args.compile)
        record["first_step_s"][name] = first_step(steps[name], device)
        print(f"{name}: first step {record['first_step_s'][name]:.1f} s (autotuning, compiling)", flush=True)
        save()
    record["ms"] = time_steps(steps, device, args.steps, args.rounds, progress=True)
    median = {name: sorted(ms)[len(ms) // 2] for name, ms in record["ms"].items()}
    record["tokens_per_s"] = {name: round(args.batch * args.seq / (ms * 1e-3)) for name, ms in median.items()}
    record["vs_sdpa"] = {name: round(median["sdpa"] / ms, 3) for name, ms in median.items() if name != "sdpa"}
    save()
    if args.profile:
        record["profile"] = {name: op_profile(step, device, by="device" if device == "cuda" else "host")
                             for name, step in steps.items()}
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["complete"] = True
    save()
    for name, ms in record["ms"].items():
        print(f"{name:<12} {record['tokens_per_s'][name]:>10,} tok/s  step {median[name]:8.2f} ms  "
              f"({' '.join(f'{m:.2f}' for m in ms)})")
    print(f"throughput over SDPA's: {record['vs_sdpa']}")
    own = "self_device_us" if device == "cuda" else "self_host_us"
    for name, rows in record.get("profile", {}).items():
        print(f"{name}: one step's ops by own {own.split('_')[1]} time (us)")
        print("\n".join(op_lines(rows, (own,))))
    return 0
