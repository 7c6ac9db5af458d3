"""Where deterministic training spends its extra time: the CUDA kernels of a few gpu-6l training steps, by
total time, with `deterministic` on or off (one setting per process: cuBLAS reads its workspace setting once),
on random tokens or on batches of a data folder (real text repeats some token ids thousands of times a batch).
First it prints how many graphs Dynamo makes of the model's forward and its first break reasons.

    python3 scripts/profile_determinism.py --deterministic 1 [--data data/gpt2-english+code] > det.txt
    python3 scripts/profile_determinism.py --deterministic 0 [--data ...] > default.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from lowprec.configs import get_config
from lowprec.data import sample_batch
from lowprec.model import GPT
from lowprec.train import load_tokens, make_optimizer, set_determinism


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", default=None, help="a token folder (default: random tokens)")
    args = parser.parse_args()
    set_determinism(bool(args.deterministic))
    cfg = get_config("gpu-6l", ["attention=triton/precision=fa2"])
    torch.manual_seed(0)
    model = GPT(cfg.model).cuda()
    optimizer = make_optimizer(model, cfg, torch.device("cuda"))
    if args.data:
        x = sample_batch(load_tokens(args.data).train, 1, 0, cfg.batch_size, 1024, device="cuda")[0]
    else:
        x = torch.randint(0, 50257, (cfg.batch_size, 1024), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphs = torch._dynamo.explain(model)(x, x)
    print(f"{graphs.graph_count} graph(s), {graphs.graph_break_count} graph break(s)")
    for reason in graphs.break_reasons[:3]:
        print("  break:", reason.reason.splitlines()[0][:200])
    torch._dynamo.reset()
    forward = torch.compile(model)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x, x)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.steps):  # compile, autotune
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"deterministic={args.deterministic}, {args.data or 'random tokens'}: {step_ms:.2f} ms a step, "
          f"loss {loss.item():.6f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
