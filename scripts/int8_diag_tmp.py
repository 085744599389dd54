import sys, torch, traceback
sys.path.insert(0, '.')
from pbs.kernels.block_sparse_attn import KernelConfig, _launch, prepare_call, quantize_call
import pbs
q, k, v = (torch.randn(1, h, 1024, 128, device="cuda").bfloat16() for h in (4, 2, 2))
plan = pbs.plan(q.float(), k.float(), pbs.PBSConfig(backend="reference", check_finite=False, selector={"name": "budget", "density": 0.5}, permuter="none"))
call = prepare_call(q, k, v, plan.mask, None, None, None, True, None)
quantize_call(call, "int8_qk")
for cfg in ("64,128,4,3", "128,128,8,2", "64,64,4,1"):
    try:
        _launch(call, KernelConfig.parse(cfg)); torch.cuda.synchronize(); print(cfg, "ok")
    except Exception as e:
        print(cfg, "".join(traceback.format_exception_only(e))[-1500:])
