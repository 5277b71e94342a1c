# F.grid_sample bf16 channels-last input vs fp64 (poison before calls). args: dt layout N,C,H,W,Ho,Wo mode pad ac seed
import sys, torch, torch.nn.functional as F
a = sys.argv + [None] * 10
dt = {'bf16': torch.bfloat16, 'f32': torch.float32}[a[1] or 'bf16']
mf = torch.channels_last if (a[2] or 'cl') == 'cl' else torch.contiguous_format
N, C, H, W, Ho, Wo = [int(v) for v in (a[3] or '1,37,33,32,1,9').split(',')]
mode = a[4] or 'bilinear'; pad = a[5] or 'border'; ac = (a[6] or '0') == '1'; seed = int(a[7] or 0)
g = torch.Generator().manual_seed(seed)
x0 = torch.randn(N, C, H, W, generator=g, dtype=torch.float64).to(dt)
gr0 = (-1.2 + 2.4 * torch.rand(N, Ho, Wo, 2, generator=g, dtype=torch.float64)).to(dt)
dy0 = torch.randn(N, C, Ho, Wo, generator=g, dtype=torch.float64).to(dt)
def run(x, gr, dy):
    x = x.clone().requires_grad_()
    p = torch.full((1 << 16,), 1e30); del p
    y = F.grid_sample(x, gr, mode=mode, padding_mode=pad, align_corners=ac)
    p = torch.full((1 << 16,), 1e30); del p
    gx, = torch.autograd.grad(y, [x], dy)
    return [y, gx]
ref = run(x0.double(), gr0.double(), dy0.double())
worst = [0, 0]
for rep in range(3):
    got = run(x0.contiguous(memory_format=mf), gr0, dy0.contiguous(memory_format=mf))
    errs = [((t.double() - r).abs().max() / r.abs().max()).item() if torch.isfinite(t).all() else float('inf') for t, r in zip(got, ref)]
    worst = [max(u, v) for u, v in zip(worst, errs)]
print(('WRONG ' if max(worst) > 0.1 else 'ok ') + 'worst err y,gx = %.3g %.3g' % tuple(worst))
