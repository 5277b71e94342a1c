"""One fused training step against fp64, for the smoke run at another torch (tools/smoke_torch.sh): a fused conv-BN-ReLU
layer's forward, backward and running statistics equal the stock modules' in fp64, and in fp32 stay within 3x of the
stock fp32 step's error against fp64; the same inside a non-reentrant gradient checkpoint, on an input the block
computes; the kernels load without torch's 'No CUDA runtime is found' line; and the all-gather of synchronized
statistics a GPU runs (on a one-rank gloo group). Prints what it ran; exits non-zero on a mismatch."""
import copy, os, subprocess, sys, tempfile, warnings, torch
from torch import nn
from torch.utils.checkpoint import checkpoint
import clfast
from clfast import ops
from clfast.fused import FusedConvBN2d, set_layer_way

# torch 2.4's checkpoint calls its own deprecated torch.cpu.amp.autocast: its warning, not clfast's
warnings.filterwarnings('ignore', message=r'`torch\.cpu\.amp\.autocast', category=FutureWarning)
set_layer_way('fused')   # clfast's op itself, never the stock way the default may time faster
assert ops.kernels_ready(), "the C++ kernels did not load"
torch.manual_seed(0)
fused = FusedConvBN2d(8, 16, 3, padding=1, act='relu')
stock = fused.to_stock()   # the same parameters as Conv2d, BatchNorm2d, ReLU

def step(model, dtype, checkpointed=False):
    m = copy.deepcopy(model).to(dtype).to(memory_format=torch.channels_last).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 12, 12, generator=g).to(dtype).to(memory_format=torch.channels_last).requires_grad_()
    # the block computes the layer's input (a ReLU), so backward's recomputation must record that op's autograd
    out = checkpoint(lambda t: m(t.relu()), x, use_reentrant=False) if checkpointed else m(x)
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    bn = m.bn if isinstance(m, FusedConvBN2d) else m[1]
    return [out, x.grad, *(p.grad for p in m.parameters()), bn.running_mean, bn.running_var]

def err(a, b): return max(((p.double() - q.double()).abs().max() / q.double().abs().max().clamp(min=1e-30)).item() for p, q in zip(a, b))

want = step(stock, torch.float64)
fp64, fp32, stock32 = err(step(fused, torch.float64), want), err(step(fused, torch.float32), want), err(step(stock, torch.float32), want)
print(f"torch {torch.__version__}, clfast {clfast.__version__}: fused step vs stock fp64: fp64 {fp64:.1e}, fp32 {fp32:.1e} "
      f"(stock fp32 {stock32:.1e})")
if fp64 > 1e-9 or fp32 > 3 * stock32: sys.exit("FAIL: the fused step is off fp64")
want = step(stock, torch.float64, True)
fp64, fp32, stock32 = (err(step(m, dt, True), want) for m, dt in [(fused, torch.float64), (fused, torch.float32), (stock, torch.float32)])
print(f"the same step inside a gradient checkpoint: fp64 {fp64:.1e}, fp32 {fp32:.1e} (stock fp32 {stock32:.1e})")
if fp64 > 1e-9 or fp32 > 3 * stock32: sys.exit("FAIL: the checkpointed fused step is off fp64")
with tempfile.TemporaryDirectory() as toolkit:   # a CUDA toolkit's folder and no GPU: torch looks no further
    run = lambda code: subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                                      env={**os.environ, 'CUDA_HOME': toolkit})
    said = run('import torch.utils.cpp_extension').stderr
    ours = run('from clfast import ops; assert ops.kernels_ready()')
print(f"loading the kernels where a CUDA toolkit and no GPU are: torch {'says' if 'No CUDA runtime' in said else 'says nothing'},"
      f" clfast {'says nothing' if ours.returncode == 0 and 'No CUDA runtime' not in ours.stderr else 'failed: ' + ours.stderr}")
if ours.returncode or 'No CUDA runtime' in ours.stderr: sys.exit("FAIL: loading the kernels printed torch's CUDA warning")
# the all-gather a GPU's synchronized layers run (NCCL): `all_gather_single` from torch 2.13, the older name before
import torch.distributed as dist
from clfast.syncstats import _all_gather_single
dist.init_process_group('gloo', init_method=f"file://{tempfile.mktemp(prefix='clfast-smoke-')}", rank=0, world_size=1)
rows = torch.arange(6, dtype=torch.float64).view(2, 3)
every = torch.empty_like(rows)
_all_gather_single(every, rows, group=dist.group.WORLD)
dist.destroy_process_group()
print(f"the synchronized layers' all-gather on this torch: {'right' if torch.equal(every, rows) else 'WRONG'}")
if not torch.equal(every, rows): sys.exit("FAIL: the all-gather of synchronized BN statistics")
