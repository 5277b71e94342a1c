# conv_transpose2d input grad, Cout=1, input 9x1, k=3, stride (1,2), pad (2,0), output_padding (0,1) -> garbage in channels-last
import sys, torch, torch.nn.functional as F
dt = {'bf16': torch.bfloat16, 'f32': torch.float32}[sys.argv[1] if len(sys.argv) > 1 else 'f32']
mf = torch.channels_last if (sys.argv[2] if len(sys.argv) > 2 else 'cl') == 'cl' else torch.contiguous_format
g = torch.Generator().manual_seed(0)
x = torch.randn(4, 4, 9, 1, generator=g).to(dt); w = torch.randn(4, 1, 3, 3, generator=g).to(dt)
args = dict(stride=(1, 2), padding=(2, 0), output_padding=(0, 1))
xr = x.double().requires_grad_()
yr = F.conv_transpose2d(xr, w.double(), **args)
dy = torch.randn(yr.shape, generator=g).to(dt)
ref, = torch.autograd.grad(yr, [xr], dy.double())
x = x.contiguous(memory_format=mf).requires_grad_(); w = w.contiguous(memory_format=mf); dy = dy.contiguous(memory_format=mf)
worst = 0
for i in range(3):
    p = torch.full((1 << 16,), 1e30); del p
    y = F.conv_transpose2d(x, w, **args)
    p = torch.full((1 << 16,), 1e30); del p
    gx, = torch.autograd.grad(y, [x], dy)
    e = ((gx.double() - ref).abs().max() / ref.abs().max()).item() if torch.isfinite(gx).all() else float('inf')
    worst = max(worst, e)
print('WRONG' if worst > 0.1 else 'ok', 'worst gx rel err', worst)
