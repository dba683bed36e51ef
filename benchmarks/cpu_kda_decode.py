"""The CPU KDA decode step of one layer (#52): ``kda_attention_in_pool`` (states gathered once, updated in place,
scattered once) against the former formula (gather, masked copy, ``to(copy=True)``, a clone, a new state tensor
per operation, copy back, scatter; kept verbatim in ``tests/ops/test_kda_cpu_step.py``), interleaved in one
process so that the box's load hits both alike. Default model's shapes: 4 heads of 64, fp32 states, bf16 inputs; one torch thread by default, as ``kimik3 serve``
runs here (with 2 threads on this loaded box each parallel op waits for the second thread's turn on a core: the
layer took ~47 ms at batch 1 against 0.3 ms on one thread).

    python benchmarks/cpu_kda_decode.py [--batches=1,65] [--iters=200] [--threads=1]

Prints per batch the median wall and process-CPU microseconds of each and their ratio, with the load average.
CPU timings on a shared 2-core box are noisy; the interleaving keeps the ratio fair, not the absolute figures.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import arg  # noqa: E402
from kimik3.ops.kda import kda_attention_in_pool  # noqa: E402
from tests.ops.test_kda_cpu_step import _old_decode_in_pool  # noqa: E402


def main() -> None:
    bad = [a for a in sys.argv[1:] if not a.startswith(("--batches=", "--iters=", "--threads="))]
    if bad or "--help" in sys.argv:
        print(__doc__)
        sys.exit(2 if bad else 0)
    torch.set_num_threads(int(arg("threads", "1")))
    iters = int(arg("iters", "200"))
    H, K = 4, 64
    print(f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    for N in (int(b) for b in arg("batches", "1,65").split(",")):
        gen = torch.Generator().manual_seed(N)
        q, k, v, f = (torch.randn(N, H, K, generator=gen).bfloat16() for _ in range(4))
        b, A_log, dt_bias = torch.randn(N, H).bfloat16(), torch.randn(H), torch.randn(H * K)
        pool = torch.randn(N + 8, H, K, K, generator=gen) * 0.1
        slots, cu = torch.arange(N) + 4, torch.arange(N + 1)
        times = {"new": ([], []), "old": ([], [])}
        for it in range(iters + 5):
            for name in ("old", "new") if it % 2 else ("new", "old"):
                w, c = time.perf_counter(), time.process_time()
                if name == "new":
                    kda_attention_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, slots, None, [1] * N, cu, True)
                else:
                    _old_decode_in_pool(q, k, v, f, b, A_log, dt_bias, -5.0, pool, slots, None)
                if it >= 5:
                    times[name][0].append((time.perf_counter() - w) * 1e6)
                    times[name][1].append((time.process_time() - c) * 1e6)
        (nw, nc), (ow, oc) = ([statistics.median(x) for x in times[n]] for n in ("new", "old"))
        print(f"N={N:3d}: new wall {nw:8.1f} us cpu {nc:8.1f} us | old wall {ow:8.1f} us cpu {oc:8.1f} us | "
              f"old/new wall {ow / nw:.2f}x cpu {oc / nc:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
