# F.max_pool2d where some pooling window lies entirely in the padding: H=1, kernel 2, padding 1, dilation 2
# (rows -1 and +1 only). Output is -inf with out-of-range indices; backward scatters out of bounds (heap corruption).
import sys, torch, torch.nn.functional as F
dt = {'bf16': torch.bfloat16, 'f32': torch.float32, 'f64': torch.float64}[sys.argv[1] if len(sys.argv) > 1 else 'bf16']
mf = torch.channels_last if (sys.argv[2] if len(sys.argv) > 2 else 'cl') == 'cl' else torch.contiguous_format
torch.manual_seed(0)
x = torch.randn(1, 2, 1, 7).to(dt).contiguous(memory_format=mf).requires_grad_()
p = torch.full((1 << 16,), 1e30); del p
y, idx = F.max_pool2d(x, 2, 3, 1, 2, return_indices=True)
bad = (not torch.isfinite(y).all().item()) or idx.max().item() >= 7 or idx.min().item() < 0
print('WRONG' if bad else 'ok', 'y', y.flatten().tolist(), 'idx', idx.flatten().tolist(), flush=True)
p = torch.full((1 << 16,), 1e30); del p
y.backward(torch.ones_like(y))
for i in range(100):  # heap churn so glibc notices corruption
    z = [torch.empty(k * 8 + 1) for k in range(1, 64)]; del z
print('survived')
