"Surgery coverage over the model zoo (tests/zoo_models.py): fused / total BN per model and the top reasons BNs were left unfused"
import sys, time
from collections import Counter
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent/'tests'))
from zoo_models import ZOO
from clfast.fuse import fuse_conv_bn, fusion_report

def coverage(names=None, verbose=True):
    "`{name: (fused BNs, total BNs, Counter of reasons)}` for the zoo models `names` (all by default)"
    out = {}
    for name in names or ZOO:
        t = time.perf_counter()
        m = ZOO[name][0]()
        r = fusion_report(fuse_conv_bn(m))
        out[name] = (r.n_bn - len(r.unfused), r.n_bn, Counter(why for _, why in r.unfused))
        if verbose:
            f, n, why = out[name]
            top = '; '.join(f"{k} ×{v}" for k, v in why.most_common(2))
            print(f"| {name:24s} | {f:4d} / {n:4d} | {f / max(n, 1):6.1%} | {time.perf_counter() - t:5.1f}s | {top}", flush=True)
    return out

if __name__ == '__main__':
    print(f"| {'model':24s} | fused / BN  | cover  | time   | top reasons left unfused")
    print(f"|{'-'*26}|-------------|--------|--------|-------------------------")
    res = coverage(sys.argv[1:] or None)
    f, n = sum(v[0] for v in res.values()), sum(v[1] for v in res.values())
    print(f"\n{len(res)} models: {f} / {n} BN fused = {f / n:.1%}")
    reasons = sum((v[2] for v in res.values()), Counter())
    for k, v in reasons.most_common(8): print(f"  {v:4d}  {k}")
