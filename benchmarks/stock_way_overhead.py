"""Host time per forward of a tiny conv-BN-ReLU layer (1 thread, no_grad): the stock modules, a fused module run its
stock way, and a fused module under 'timed' that chose stock (the way's lookup included). The stock way here uses
stock BN (clfast's precise BN, where this CPU's premise asks for it, would make it another computation).

    python benchmarks/stock_way_overhead.py [--profile]
"""
import time, copy, statistics, torch, cProfile, pstats, sys
from torch import nn
from clfast.fuse import fuse_conv_bn
from clfast import fused as F_
from clfast import guard
F_.IMPRECISE_CL_BATCH_NORM = type("P", (), {"present": staticmethod(lambda: False)})()   # stock BN in the stock way
torch.set_num_threads(1)
stock = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()).to(memory_format=torch.channels_last)
fused = fuse_conv_bn(copy.deepcopy(stock), 'speed')
x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
def fwd(m, way=None, n=500):
    def f():
        prev = F_.set_layer_way(way) if way else None
        with torch.no_grad():
            for _ in range(n): m(x)
        if way: F_.set_layer_way(prev)
    return f
from clfast import timing
F_._ways.clear(); timing._here.clear()
fns = {'stock modules': fwd(stock), 'fused, way stock': fwd(fused, 'stock'), 'fused, timed->stock': fwd(fused, 'timed')}
F_.decide = lambda key, measure: timing.Timing(0.5, 6, True, 0.)   # 'timed' chose stock (nothing measured or cached)
for f in fns.values(): f()
res = {k: [] for k in fns}
for r in range(9):
    for k, f in fns.items():
        t = time.perf_counter(); f(); res[k].append((time.perf_counter() - t) / 500 * 1e6)
for k, v in res.items(): print(f"{k:>22}: {statistics.median(v):6.1f} us per layer forward")
if '--profile' in sys.argv:
    F_.set_layer_way('timed')
    pr = cProfile.Profile(); pr.enable()
    with torch.no_grad():
        for _ in range(5000): fused(x)
    pr.disable(); pstats.Stats(pr).sort_stats('tottime').print_stats(25)
