# conv_transpose2d bf16 weight grad on a 1x2 map (depthwise, k=1x3, stride (1,2), pad (0,2)) -> garbage/inf in channels-last
import sys, torch, torch.nn.functional as F
mf = torch.channels_last if (sys.argv[1] if len(sys.argv) > 1 else 'cl') == 'cl' else torch.contiguous_format
dt = torch.bfloat16
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 4, 1, 2, generator=g).to(dt); w = torch.randn(4, 1, 1, 3, generator=g).to(dt)
args = dict(stride=(1, 2), padding=(0, 2), groups=4)
dy = torch.randn(3, 4, 1, 1, generator=g).to(dt)
wr = w.double().requires_grad_()
ref, = torch.autograd.grad(F.conv_transpose2d(x.double(), wr, **args), [wr], dy.double())
x, dy = x.contiguous(memory_format=mf), dy.contiguous(memory_format=mf)
w = w.contiguous(memory_format=mf).requires_grad_()
worst = 0
for i in range(3):
    p = torch.full((1 << 16,), 1e30); del p
    y = F.conv_transpose2d(x, w, **args)
    p = torch.full((1 << 16,), 1e30); del p
    gw, = torch.autograd.grad(y, [w], dy)
    e = ((gw.double() - ref).abs().max() / ref.abs().max()).item() if torch.isfinite(gw).all() else float('inf')
    worst = max(worst, e)
print('WRONG' if worst > 0.1 else 'ok', 'worst gw rel err', worst)
