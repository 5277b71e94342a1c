"""One fused training step against fp64, for the smoke run at another torch (tools/smoke_torch.sh): a fused conv-BN-ReLU
layer's forward, backward and running statistics equal the stock modules' in fp64, and in fp32 stay within 3x of the
stock fp32 step's error against fp64. Prints what it ran; exits non-zero on a mismatch."""
import copy, sys, torch
from torch import nn
import clfast
from clfast import ops
from clfast.fused import FusedConvBN2d, set_layer_way

set_layer_way('fused')   # clfast's op itself, never the stock way the default may time faster
assert ops.kernels_ready(), "the C++ kernels did not load"
torch.manual_seed(0)
fused = FusedConvBN2d(8, 16, 3, padding=1, act='relu')
stock = fused.to_stock()   # the same parameters as Conv2d, BatchNorm2d, ReLU

def step(model, dtype):
    m = copy.deepcopy(model).to(dtype).to(memory_format=torch.channels_last).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 12, 12, generator=g).to(dtype).to(memory_format=torch.channels_last).requires_grad_()
    out = m(x)
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    bn = m.bn if isinstance(m, FusedConvBN2d) else m[1]
    return [out, x.grad, *(p.grad for p in m.parameters()), bn.running_mean, bn.running_var]

def err(a, b): return max(((p.double() - q.double()).abs().max() / q.double().abs().max().clamp(min=1e-30)).item() for p, q in zip(a, b))

want = step(stock, torch.float64)
fp64, fp32, stock32 = err(step(fused, torch.float64), want), err(step(fused, torch.float32), want), err(step(stock, torch.float32), want)
print(f"torch {torch.__version__}, clfast {clfast.__version__}: fused step vs stock fp64: fp64 {fp64:.1e}, fp32 {fp32:.1e} "
      f"(stock fp32 {stock32:.1e})")
if fp64 > 1e-9 or fp32 > 3 * stock32: sys.exit("FAIL: the fused step is off fp64")
