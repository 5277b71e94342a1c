# F.instance_norm, N=1, C>1, upstream grad dy in channels_last (x layout irrelevant): input/weight/bias grads WRONG vs fp64 (deterministic).
# args: dt(bf16|f32) layout(cl|contig; applies to x and dy) N,C,H,W affine(1|0)
import sys, torch, torch.nn.functional as F
dt = {'bf16': torch.bfloat16, 'f32': torch.float32}[sys.argv[1] if len(sys.argv) > 1 else 'f32']
mf = torch.channels_last if (sys.argv[2] if len(sys.argv) > 2 else 'cl') == 'cl' else torch.contiguous_format
N, C, H, W = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else '1,2,2,7').split(',')]
affine = (sys.argv[4] if len(sys.argv) > 4 else '1') == '1'
g = torch.Generator().manual_seed(0)
x0 = torch.randn(N, C, H, W, generator=g, dtype=torch.float64).to(dt)
w0 = torch.randn(C, generator=g, dtype=torch.float64).to(dt); b0 = torch.randn(C, generator=g, dtype=torch.float64).to(dt)
dy0 = torch.randn(N, C, H, W, generator=g, dtype=torch.float64).to(dt)
def run(x, w, b, dy):
    x = x.clone().requires_grad_(); w = w.clone().requires_grad_() if affine else None; b = b.clone().requires_grad_() if affine else None
    p = torch.full((1 << 16,), 1e30); del p
    y = F.instance_norm(x, weight=w, bias=b, eps=1e-5)
    p = torch.full((1 << 16,), 1e30); del p
    y.backward(dy)
    return [y, x.grad] + ([w.grad, b.grad] if affine else [])
ref = run(x0.double(), w0.double(), b0.double(), dy0.double())
got = run(x0.contiguous(memory_format=mf), w0, b0, dy0.contiguous(memory_format=mf))
errs = [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref)]
print(('WRONG ' if max(errs) > 0.1 else 'ok ') + 'errs y,gx,gw,gb = ' + ' '.join('%.3g' % e for e in errs))
