import os, sys, torch
sys.path.insert(0, "bench")
from bench_moe_grouped import experts, _grouped, E, TOP_K, D
from k3run.layers.moe import fused_experts, route
torch.manual_seed(0)
ex = experts()
for t in (16, 64, 128):
    x = torch.randn(t, D, device="cuda").bfloat16()
    weights, ids = route(torch.randn(t, E, device="cuda"), torch.zeros(E, device="cuda"), TOP_K)
    loop = fused_experts(ex, x, ids, weights, grouped=False)
    by = _grouped(ex, x, ids, weights, True)
    pick = _grouped(ex, x, ids, weights, False)
    r = lambda a, b: float((a - b).norm() / b.norm())
    # per token: where the loop differs most
    tok = ((loop - pick).norm(dim=1) / pick.norm(dim=1))
    print(f"T={t}: by-expert vs per-pick {r(by, pick):.1e}, loop vs per-pick {r(loop, pick):.1e}, "
          f"by vs loop {r(by, loop):.1e}; worst token loop-vs-pick {float(tok.max()):.1e}", flush=True)
