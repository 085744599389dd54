"""Densities of bench_planning.py's configs on its workload, planned on the CPU reference path.

No GPU needed: it says how the selection rules change the density that the GPU timings depend on.
    PYTHONPATH=.:benchmarks python3 benchmarks/planning_densities.py benchmarks/results/planning_densities_paper_rules_cpu.json
"""
import json, sys, time, torch, pbs
from benchmarks.bench_planning import METHODS
rows = []
for n in [4096, 8192, 16384, 32768]:
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=32, heads_kv=8, seq_len=n, head_dim=128, dtype=torch.bfloat16)
    for name, m in METHODS.items():
        t = time.time()
        old = None
        cfg = pbs.PBSConfig(block_size=128, segment_size=256, backend="reference", **m)
        p = pbs.plan(q, k, cfg)
        rows.append({"N": n, "method": name, "density": p.density})
        print(n, name, round(p.density, 3), round(time.time() - t, 1), flush=True)
json.dump({"note": "densities of the planning benchmark's configs on its make_qkv workload (bf16 inputs, B=1, Hq=32, Hkv=8, D=128, S=256, block 128), planned on the CPU reference path with the paper-exact selection rules", "torch": torch.__version__, "rows": rows}, open(sys.argv[1], "w"), indent=1)
