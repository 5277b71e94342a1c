# conv_transpose2d weight grad, channels-last, 1x1 kernel, stride 3, output_padding 2 (= stride-1, output = 3*H exactly)
# -> heap corruption (glibc abort / segfault) in stock PyTorch CPU (oneDNN). Contiguous layout is fine.
import sys, torch, torch.nn.functional as F
dt = {'bf16': torch.bfloat16, 'f32': torch.float32}[sys.argv[1] if len(sys.argv) > 1 else 'bf16']
mf = torch.channels_last if (sys.argv[2] if len(sys.argv) > 2 else 'cl') == 'cl' else torch.contiguous_format
torch.manual_seed(0)
x = torch.randn(3, 16, 8, 8).to(dt).contiguous(memory_format=mf)
w = torch.randn(16, 9, 1, 1).to(dt).contiguous(memory_format=mf).requires_grad_()
dy = torch.randn(3, 9, 24, 24).to(dt).contiguous(memory_format=mf)
for i in range(3):
    p = torch.full((1 << 16,), 1e30); del p
    y = F.conv_transpose2d(x, w, None, stride=3, padding=0, output_padding=2)
    p = torch.full((1 << 16,), 1e30); del p
    gw, = torch.autograd.grad(y, [w], dy)
    ref = torch.einsum('nihw,nohw->io', x.double(), dy.double()[:, :, ::3, ::3])[:, :, None, None]
    print('gw rel err', ((gw.double() - ref).abs().max() / ref.abs().max()).item(), flush=True)
for i in range(100):  # heap churn so glibc notices corruption
    z = [torch.empty(k * 8 + 1) for k in range(1, 64)]; del z
print('survived')
