# one conv_transpose2d geometry: fwd + grads vs fp64, with poison; exit code != 0 on crash
# args: dt layout N Cin Cout H W G kh kw sh sw ph pw oph opw dh dw [which=xw] [reps=3]
import sys, torch, torch.nn.functional as F
a = sys.argv
dt = {'bf16': torch.bfloat16, 'f32': torch.float32, 'f16': torch.float16}[a[1]]; cl = a[2] == 'cl'
N, Cin, Cout, H, W, G, kh, kw, sh, sw, ph, pw, oph, opw, dh, dw = map(int, a[3:19])
which = a[19] if len(a) > 19 else 'xw'; reps = int(a[20]) if len(a) > 20 else 3
torch.manual_seed(0)
x = torch.randn(N, Cin, H, W).to(dt); w = torch.randn(Cin, Cout // G, kh, kw).to(dt)
args = ((sh, sw), (ph, pw), (oph, opw), G, (dh, dw))
xr = x.double().requires_grad_(); wr = w.double().requires_grad_()
yr = F.conv_transpose2d(xr, wr, None, *args)
dy = torch.randn(yr.shape).to(dt)
gx, gw = torch.autograd.grad(yr, [xr, wr], dy.double())
if cl:
    x, w, dy = [t.contiguous(memory_format=torch.channels_last) for t in (x, w, dy)]
x.requires_grad_('x' in which); w.requires_grad_('w' in which)
E = lambda g, r: ((g.double() - r).abs().max() / r.abs().max()).item() if torch.isfinite(g).all() else float('inf')
res = []
for rep in range(reps):
    p = torch.full((1 << 16,), 1e30); del p
    y = F.conv_transpose2d(x, w, None, *args)
    p = torch.full((1 << 16,), 1e30); del p
    ins = [t for t in (x, w) if t.requires_grad]
    gs = torch.autograd.grad(y, ins, dy) if ins else []
    r = dict(y=E(y, yr.detach()))
    for t, g in zip(ins, gs):
        r['gx' if t is x else 'gw'] = E(g, gx if t is x else gw)
    res.append(r)
# churn the heap so corruption is detected
for i in range(200):
    z = [torch.empty(k * 8 + 1) for k in range(1, 64)]; del z
W = max(max(r.values()) for r in res) > 0.1
print("WRONG" if W else "ok", res[0], 'worst', {k: max(r[k] for r in res) for k in res[0]}, flush=True)
