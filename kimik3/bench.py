"""Offline throughput: N requests with random input/output lengths through ``LLM.generate``.

Reports output tokens/s, TTFT / TPOT percentiles, engine host overhead per step, and the ratio
against running the same requests one at a time (batching gain). Without --model it writes a tiny
random checkpoint to a temp dir, so the numbers then measure the engine's overhead, not a GPU.

    kimik3 bench --arch kimi_linear --num-requests 64      (or python benchmarks/throughput.py ...)
"""

from __future__ import annotations

import argparse
import datetime
import random
import subprocess
import tempfile
import time

import torch

from kimik3.engine import LLM, SamplingParams


def percentiles(values: list[float], ps=(50, 90, 99)) -> str:
    if not values:
        return "n/a"
    t = torch.tensor(values, dtype=torch.float64)
    return ", ".join(f"p{p} {float(t.quantile(p / 100)) * 1e3:.1f} ms" for p in ps)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def add_bench_arguments(ap: argparse.ArgumentParser) -> None:
    from kimik3.engine.flags import add_engine_args

    ap.add_argument("--model", help="checkpoint directory (default: a tiny random checkpoint written to a temp dir)")
    ap.add_argument("--arch", default="kimi_k3", choices=["kimi_k3", "kimi_linear"],
                    help="tiny checkpoint kind (default: kimi_k3)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests (default: 64)")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                    help="prompt lengths, uniform (default: 16 256)")
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"),
                    help="output lengths, uniform (default: 16 128)")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 requests (default: sampled, seeded)")
    ap.add_argument("--baseline-requests", type=int, default=16,
                    help="requests run one at a time for the ratio; 0 = all (default: 16)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_args(ap, skip=("model",))


def bench_main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)

    path = args.model
    if path is None:
        from kimik3.testing import make_tiny_checkpoint
        path = str(make_tiny_checkpoint(tempfile.mkdtemp(prefix="kimik3-bench-"), arch=args.arch, seed=args.seed))
    from kimik3.engine.args import EngineArgs

    ea = EngineArgs.from_cli(args)
    kwargs = {f: getattr(ea, f) for f in vars(ea) if f != "model"}
    if kwargs["max_model_len"] is None:     # long enough for the longest request
        kwargs["max_model_len"] = args.input_len[1] + args.output_len[1]
    llm = LLM(path, **kwargs)
    vocab = llm.engine.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))] for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0.0 if args.greedy else 1.0, seed=i, ignore_eos=True,
                             max_tokens=rng.randint(*args.output_len)) for i in range(args.num_requests)]

    run(llm, [[1, 2, 3]], [SamplingParams(max_tokens=4)])          # warm-up
    llm.reset_prefix_cache()
    before = llm.engine.stats()
    elapsed, outs = run(llm, prompts, params)
    after = llm.engine.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(map(len, prompts))
    steps = after.num_steps - before.num_steps
    ttft = [o.metrics["ttft_s"] for o in outs]
    tpot = [o.metrics["tpot_s"] for o in outs if "tpot_s" in o.metrics]

    llm.reset_prefix_cache()       # the one-at-a-time runs must not reuse the batch's prompts
    k = args.baseline_requests or args.num_requests
    idx = list(range(min(k, args.num_requests)))
    t_seq = 0.0
    for i in idx:
        dt, _ = run(llm, [prompts[i]], [params[i]])
        t_seq += dt
    seq_out = sum(params[i].max_tokens for i in idx)
    seq_tps = seq_out / t_seq
    total = llm.engine.stats()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"kimik3 throughput  commit {commit or '?'}  {datetime.date.today()}  "
          f"device {llm.engine.device}  dtype {llm.engine.model.dtype}  threads {torch.get_num_threads()}")
    print(f"model {path}")
    print(f"{args.num_requests} requests: {n_in} input + {n_out} output tokens in {elapsed:.2f} s, {steps} steps")
    print(f"output throughput  {n_out / elapsed:.1f} tok/s   (total {(n_in + n_out) / elapsed:.1f} tok/s)")
    print(f"TTFT  {percentiles(ttft)}")
    print(f"TPOT  {percentiles(tpot)}")
    print(f"engine host time   {(after.host_seconds - before.host_seconds) / steps * 1e3:.2f} ms/step "
          f"(model {(after.model_seconds - before.model_seconds) / steps * 1e3:.2f} ms/step)")
    print(f"one at a time      {seq_tps:.1f} tok/s over {len(idx)} requests -> batching gain "
          f"{n_out / elapsed / seq_tps:.2f}x")
    print(f"preemptions {total.num_preemptions}, prefix hit rate {after.prefix_hit_rate:.1%}")
    if args.num_speculative_tokens:
        print(f"speculative drafts {total.num_draft_tokens}, accepted {total.num_accepted_tokens} "
              f"({total.num_accepted_tokens / max(total.num_draft_tokens, 1):.1%})")
    return 0
