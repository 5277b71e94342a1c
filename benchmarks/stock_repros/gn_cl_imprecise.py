# F.group_norm fp32 on channels-last input with non-zero-mean data (x+shift): error vs fp64, CL vs contiguous
import sys, torch, torch.nn.functional as F
shift = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
N, C, H, W, G = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else '1,5,13,38,5').split(',')]
g = torch.Generator().manual_seed(0)
x0 = torch.randn(N, C, H, W, generator=g, dtype=torch.float64).float() + shift
w0 = torch.randn(C, generator=g).float(); b0 = torch.randn(C, generator=g).float()
dy0 = torch.randn(N, C, H, W, generator=g).float()
def run(x, w, b, dy):
    x = x.clone().requires_grad_(); w = w.clone().requires_grad_(); b = b.clone().requires_grad_()
    p = torch.full((1 << 16,), 1e30); del p
    y = F.group_norm(x, G, w, b, 1e-3)
    p = torch.full((1 << 16,), 1e30); del p
    y.backward(dy)
    return [y, x.grad, w.grad, b.grad]
ref = run(x0.double(), w0.double(), b0.double(), dy0.double())
E = {}
for name, mf in (('contig', torch.contiguous_format), ('cl', torch.channels_last)):
    got = run(x0.contiguous(memory_format=mf), w0, b0, dy0.contiguous(memory_format=mf))
    E[name] = [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref)]
imp = any(c > 4 * o and c > 8 * 2 ** -24 for c, o in zip(E['cl'], E['contig']))
print('WRONG-IMPRECISE' if imp else 'ok', 'y,gx,gw,gb  contig', ' '.join('%.2e' % v for v in E['contig']), '| cl', ' '.join('%.2e' % v for v in E['cl']))
