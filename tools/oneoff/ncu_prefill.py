"""ncu target: the kit's invariant prefill (step keys, TMA) at 1x4096 and the ladder's flash rung, 3 launches each."""
import sys
import torch
from batch_invariance_kit.ops import attention as A
from batch_invariance_kit.bench import attention_ladder as L

which = sys.argv[1]
cell = L.make_cell(1, 4096)
q, n = cell["q"], 4096
out = torch.empty_like(q)
if which == "kit":
    plan = A.make_plan([n], [0, n], q_heads=L.HQ, kv_heads=L.HKV, head_dim=L.D, device=q.device)
    kn, vn = cell["k"][0], cell["v"][0]
    for _ in range(3):
        A.launch(plan, q, cell["kc"], cell["vc"], cell["bt"], L.D ** -0.5, out, key=kn, value=vn,
                 query_start_loc=cell["qsl"])
else:
    run = L.make_launch(dict(PAGED=False, PACK=False), (128, 64, 8, 3), cell, out)
    for _ in range(3):
        run()
torch.cuda.synchronize()
print("done", which)
