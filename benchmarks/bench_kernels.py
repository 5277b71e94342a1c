"""Benchmark the fused conv-BN layer's kernels, side by side in one run.

CPU: one training step (forward + backward) of a fused layer through `clfast.ops.fused_conv_bn` (the C++ backend) vs
the pure-PyTorch reference backend vs stock conv + `F.batch_norm` + activation under autograd, on ResNet-50 and
EfficientNet-B0 layer shapes at batch 16, 160 px, fp32; prints times and ratios.
CUDA (when a GPU is present): achieved bandwidth of each Triton kernel vs a measured device-to-device copy
(`y.clone()`) on ResNet-50 activation shapes at batch 256, 224 px, bf16 and fp16.
Then fused BN + ReLU (+ add) forward + backward vs stock (F.batch_norm, add, ReLU under autograd) on the same shapes,
beside the stock / fused ratio `clfast.gpu_report`'s traffic model predicts. GPU times are the GPU's alone
(`triton.testing.do_bench`: L2 flushed before each run, the host's issue time hidden behind the flush); the host's
time to issue each is printed beside them (until 2026-11-26 the two were one figure, which the small shapes' host
time inflated).

Run under the shared CPU lock:  flock /tmp/clfast-cpu.lock python benchmarks/bench_kernels.py [--device cpu|cuda]
"""
import argparse, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository's clfast, run from anywhere (the GPU machine installs none)
import torch
import torch.nn.functional as F
from clfast import ops
from clfast.reference import ConvGeometry, as_rows
from clfast.act import ACTS

# (name, N, Cin, H, Cout, kernel, stride, groups, act): a ResNet-50 bottleneck's 3x3 and 1x1 convs, and
# EfficientNet-B0's depthwise 3x3 / 5x5 and pointwise convs, at batch 16, 160 px
CPU_LAYERS = [('r50 3x3 64', 16, 64, 40, 64, 3, 1, 1, 'relu'), ('r50 1x1 64->256', 16, 64, 40, 256, 1, 1, 1, 'none'),
              ('r50 3x3 256', 16, 256, 10, 256, 3, 1, 1, 'relu'),
              ('eff dw3x3 96', 16, 96, 80, 96, 3, 2, 96, 'silu'), ('eff dw5x5 240', 16, 240, 20, 240, 5, 1, 240, 'silu'),
              ('eff 1x1 240->40', 16, 240, 20, 40, 1, 1, 1, 'none'), ('eff 1x1 40->240', 16, 40, 20, 240, 1, 1, 1, 'silu')]
CUDA_SHAPES = [(256, 64, 112, 112), (256, 256, 56, 56), (256, 512, 28, 28), (256, 1024, 14, 14), (256, 2048, 7, 7)]

def make(shape, dtype, device, res):
    "A channels-last activation, BN affine parameters (fp32), an optional residual and an output gradient"
    cl = dict(memory_format=torch.channels_last)
    y = torch.randn(shape, device=device).to(dtype).contiguous(**cl)
    w, b = torch.rand(shape[1], device=device) + .5, torch.randn(shape[1], device=device)
    r = torch.randn(shape, device=device).to(dtype).contiguous(**cl) if res else None
    return y, w, b, r, torch.randn(shape, device=device).to(dtype).contiguous(**cl)

def layer(name, n, cin, h, cout, k, stride, groups, act):
    "Inputs of one layer, channels-last fp32, and its geometry"
    cl = torch.channels_last
    x = torch.randn(n, cin, h, h).to(memory_format=cl).requires_grad_()
    w = (torch.randn(cout, cin // groups, k, k) * 0.1).to(memory_format=cl).requires_grad_()
    bw, bb = (torch.rand(cout) + .5).requires_grad_(), torch.randn(cout).requires_grad_()
    return x, w, bw, bb, ConvGeometry((stride, stride), (k // 2, k // 2), (1, 1), groups), act

def fused_step(x, w, bw, bb, geom, act):
    rm, rv, nbt = torch.zeros(w.shape[0]), torch.ones(w.shape[0]), torch.zeros((), dtype=torch.long)
    out = ops.fused_conv_bn(x, w, None, bw, bb, rm, rv, nbt, True, 0.1, 1e-5, geom, act=act)
    torch.autograd.grad(out, (x, w, bw, bb), torch.ones_like(out))

def ref_step(*a):
    with ops.kernels_from('ref'): fused_step(*a)

def stock_step(x, w, bw, bb, geom, act):
    rm, rv = torch.zeros(w.shape[0]), torch.ones(w.shape[0])
    out = ACTS[act](F.batch_norm(F.conv2d(x, w, None, *geom), rm, rv, bw, bb, True, 0.1, 1e-5), 0.)
    torch.autograd.grad(out, (x, w, bw, bb), torch.ones_like(out))

def bench_cpu(reps):
    print(f"CPU, {torch.get_num_threads()} threads; one training step (fwd+bwd) of conv + BN + act, fp32, channels-last; "
          f"median of {reps} interleaved rounds")
    ops.kernels_ready()     # build/load the C++ kernels before timing
    print(f"{'layer':>18} {'act':>5} {'C++ ms':>8} {'ref ms':>8} {'stock ms':>9} {'stock/C++':>10} {'ref/C++':>8}")
    for spec in CPU_LAYERS:
        args = layer(*spec)
        fns = dict(cpp=fused_step, ref=ref_step, stock=stock_step)
        times = {k: [] for k in fns}
        for f in fns.values(): f(*args)            # warm up
        for i in range(reps):                      # interleaved, order reversed every other round: drift hits all alike
            for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                t = time.perf_counter(); fns[k](*args); times[k].append(time.perf_counter() - t)
        t = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{spec[0]:>18} {spec[-1]:>5} {t['cpp']:8.2f} {t['ref']:8.2f} {t['stock']:9.2f} "
              f"{t['stock']/t['cpp']:10.2f} {t['ref']/t['cpp']:8.2f}")

def cuda_time(f, reps=20):
    """Median milliseconds of `f()` on the GPU alone, by `triton.testing.do_bench`: L2 flushed before each run, by a
    memset that keeps the GPU busy while the host issues `f`'s launches, so the host's time is not in it where it is
    shorter than the memset (~60 us on an H200): the Triton kernels are timed through their compiled kernels (~2 us a
    launch, `launching('compiled')`), not Triton's JIT (~12 us), which a small shape's backward could have exceeded"""
    import triton.testing
    return triton.testing.do_bench(f, warmup=max(5, reps), rep=max(20, 5 * reps), return_mode='median')

def issue_time(f, reps=20):
    "Median microseconds the host takes to issue `f()` (its Python and launches; the GPU synchronized between runs)"
    for _ in range(3): f()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6

def bench_cuda(reps):
    from clfast import triton_kernels as tk
    print(f"CUDA {torch.cuda.get_device_name()}: bandwidth of each Triton kernel vs a device-to-device copy (GPU time "
          "alone), and the host's time to issue each")
    print(f"{'shape':>22} {'dtype':>9} {'copy GB/s':>10} {'stats':>7} {'fwd':>7} {'fwd+add':>8} {'bwd':>7} "
          f"{'bwd+add':>8}  (fraction of copy bandwidth) | host us: stats fwd bwd")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in CUDA_SHAPES:
            y, w, b, r, g = make(shape, dtype, 'cuda', True)
            x, xr, xg = as_rows(y), as_rows(r), as_rows(g)
            nb = y.numel() * y.element_size()
            copy_bw = 2 * nb / cuda_time(y.clone, reps) / 1e6
            mean, var = tk.stats(x)
            invstd = (var + 1e-5).rsqrt()
            scale, shift = invstd * w, b - mean * invstd * w
            runs = {  # kernel, bytes moved (reads + writes of [M, C] tensors)
                'stats': (lambda: tk.stats(x), 1),
                'fwd': (lambda: tk.fwd(x, scale, shift, None, True), 2),
                'fwd+add': (lambda: tk.fwd(x, scale, shift, xr, True), 3),
                'bwd': (lambda: tk.bwd(xg, x, mean, invstd, scale, shift, None, True, True, False), 5),
                'bwd+add': (lambda: tk.bwd(xg, x, mean, invstd, scale, shift, xr, True, True, True), 8)}
            with tk.launching('compiled'):   # GPU time: the launches' host issue kept under do_bench's L2 flush
                frac = {k: (n * nb / cuda_time(f, reps) / 1e6) / copy_bw for k, (f, n) in runs.items()}
            host = [issue_time(runs[k][0], reps) for k in ('stats', 'fwd', 'bwd')]
            print(f"{str(list(shape)):>22} {str(dtype)[6:]:>9} {copy_bw:10.0f} " +
                  ' '.join(f"{frac[k]:{max(7, len(k))}.2f}" for k in runs) + " | " + ' '.join(f"{h:.0f}" for h in host))

def model_ratio(dtype, res):
    "The traffic model's stock / fused bytes of BN + ReLU (+ add) forward + backward (clfast.gpu_report), or None"
    try:
        from clfast import gpu_report as gr
        s = torch.finfo(dtype).bits // 8
        fused = gr.fused_passes(gr.layer_step(dtype, 'relu', residual=res, grads=(True, True, res)), 'speed', s)
        return gr._sum(gr.stock_passes('relu', res, s)) / gr._sum(fused)
    except Exception as e:   # the model compiles offline with Triton internals another Triton may lack
        print(f"  (traffic model unavailable: {type(e).__name__}: {e})")
        return None

def bench_cuda_vs_stock(reps):
    """BN + ReLU (+ add), forward + backward with batch statistics: the Triton kernels' passes against stock
    F.batch_norm, add and ReLU under autograd, beside the ratio the traffic model predicts (KERNELS.md)"""
    from clfast import triton_kernels as tk
    print(f"CUDA {torch.cuda.get_device_name()}: fused BN+ReLU(+add) forward+backward vs stock, GPU ms and stock/fused; "
          "the host's us to issue each")
    print(f"{'shape':>22} {'dtype':>9} {'add':>4} {'fused':>8} {'stock':>8} {'ratio':>6} {'model':>6} {'host us':>8} {'stock':>6}")
    for dtype in (torch.bfloat16, torch.float16):
        for res in (False, True):
            predicted = model_ratio(dtype, res)
            for shape in CUDA_SHAPES:
                y, w, b, r, g = make(shape, dtype, 'cuda', res)
                x, xg, xr = as_rows(y), as_rows(g), (as_rows(r) if res else None)
                def fused():
                    mean, var = tk.stats(x)
                    invstd = (var + 1e-5).rsqrt()
                    scale = invstd * w
                    shift = b - mean * scale
                    tk.fwd(x, scale, shift, xr, True)
                    tk.bwd(xg, x, mean, invstd, scale, shift, xr, True, True, res)
                ys, ws, bs = y.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_()
                rs = r.detach().requires_grad_() if res else None
                def stock():
                    z = F.batch_norm(ys, None, None, ws, bs, training=True)
                    if res: z = z + rs
                    # grad, not backward: no accumulation into .grad, which would add a pass per step
                    torch.autograd.grad(F.relu(z, inplace=True), [ys, ws, bs] + ([rs] if res else []), g)
                with tk.launching('compiled'): tf = cuda_time(fused, reps)   # (as above; the host's time Triton's way)
                ts = cuda_time(stock, reps)
                hf, hs = issue_time(fused, reps), issue_time(stock, reps)
                print(f"{str(list(shape)):>22} {str(dtype)[6:]:>9} {'yes' if res else 'no':>4} {tf:8.3f} {ts:8.3f} "
                      f"{ts / tf:6.2f} " + (f"{predicted:6.2f}" if predicted else f"{'-':>6}") + f" {hf:8.0f} {hs:6.0f}")

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', choices=['cpu', 'cuda', 'all'], default='all')
    p.add_argument('--reps', type=int, default=15)
    p.add_argument('--threads', type=int, default=None, help='CPU threads (default: torch\'s)')
    a = p.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    if a.device in ('cpu', 'all'): bench_cpu(a.reps)
    if a.device in ('cuda', 'all'):
        if torch.cuda.is_available(): bench_cuda(a.reps); bench_cuda_vs_stock(a.reps)
        else: print("CUDA: no GPU here; the CUDA benchmark did not run (Triton kernel speed unverified)")

if __name__ == '__main__': main()
