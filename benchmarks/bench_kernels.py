"""Benchmark the BN(+add)(+ReLU) kernels of `clfast.ops`, side by side in one run.

CPU: forward+backward of the C++ kernel vs the pure-PyTorch reference vs stock `F.batch_norm` + `F.relu` (+ add) under
autograd, on ResNet-50 activation shapes at batch 8, 160 px, fp32 and bf16; prints times and ratios.
CUDA (when a GPU is present): achieved bandwidth of each Triton kernel vs a measured device-to-device copy
(`y.clone()`) on ResNet-50 activation shapes at batch 256, 224 px, bf16 and fp16.

Run under the shared CPU lock:  flock /tmp/clfast-cpu.lock python benchmarks/bench_kernels.py [--device cpu|cuda]
"""
import argparse, statistics, time
import torch
import torch.nn.functional as F
from clfast import ops

CPU_SHAPES = [(8, 64, 80, 80), (8, 256, 40, 40), (8, 512, 20, 20), (8, 1024, 10, 10)]
CUDA_SHAPES = [(256, 64, 112, 112), (256, 256, 56, 56), (256, 512, 28, 28), (256, 1024, 14, 14), (256, 2048, 7, 7)]

def make(shape, dtype, device, res):
    "A channels-last activation, BN affine parameters (fp32), an optional residual and an output gradient"
    cl = dict(memory_format=torch.channels_last)
    y = torch.randn(shape, device=device).to(dtype).contiguous(**cl)
    w, b = torch.rand(shape[1], device=device) + .5, torch.randn(shape[1], device=device)
    r = torch.randn(shape, device=device).to(dtype).contiguous(**cl) if res else None
    return y, w, b, r, torch.randn(shape, device=device).to(dtype).contiguous(**cl)

def clfast_step(y, w, b, r, g, stats=ops.bn_stats, fwd=ops.bn_act_fwd, bwd=ops.bn_act_bwd):
    "Training-mode forward + backward through the fused ops"
    mean, var = stats(y)
    invstd = (var + 1e-5).rsqrt()
    fwd(y, mean, invstd, w, b, r, True)
    return bwd(g, y, mean, invstd, w, b, r, True, True)

def ref_step(y, w, b, r, g):
    return clfast_step(y, w, b, r, g, ops.ref_bn_stats, ops.ref_bn_act_fwd, ops.ref_bn_act_bwd)

def stock_step(y, w, b, r, g):
    "Stock `F.batch_norm` (+ add) + `F.relu`, forward + backward with autograd"
    y, w, b = y.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_()
    inputs = [y, w, b]
    rm, rv = torch.zeros_like(w), torch.ones_like(w)
    z = F.batch_norm(y, rm, rv, w, b, training=True, eps=1e-5)
    if r is not None:
        r = r.detach().requires_grad_(); inputs.append(r)
        z = z + r
    return torch.autograd.grad(F.relu(z), inputs, g)

def bench_cpu(reps):
    print(f"CPU, {torch.get_num_threads()} threads; fwd+bwd of BN(+add)+ReLU, training statistics; "
          f"median (and best) of {reps} interleaved rounds")
    ops.kernel_backend('cpu')     # build/load the C++ kernels before timing
    print(f"{'shape':>20} {'dtype':>9} {'add':>4} {'C++ ms':>8} {'ref ms':>8} {'stock ms':>9} "
          f"{'stock/C++':>10} {'ref/C++':>8} {'stock/C++ (best)':>17}")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in CPU_SHAPES:
            for res in (False, True):
                args = make(shape, dtype, 'cpu', res)
                fns = dict(cpp=clfast_step, ref=ref_step, stock=stock_step)
                times = {k: [] for k in fns}
                for f in fns.values(): f(*args)            # warm up
                for _ in range(reps):                      # interleave, so drift hits all three alike
                    for k, f in fns.items():
                        t = time.perf_counter(); f(*args); times[k].append(time.perf_counter() - t)
                t = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                best = {k: min(v) for k, v in times.items()}
                print(f"{str(list(shape)):>20} {str(dtype)[6:]:>9} {'yes' if res else 'no':>4} {t['cpp']:8.2f} "
                      f"{t['ref']:8.2f} {t['stock']:9.2f} {t['stock']/t['cpp']:10.2f} {t['ref']/t['cpp']:8.2f} "
                      f"{best['stock']/best['cpp']:17.2f}")

def cuda_time(f, reps=20):
    "Median milliseconds of `f()` on the current stream, by CUDA events"
    for _ in range(3): f()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)

def bench_cuda(reps):
    from clfast import triton_kernels as tk
    print(f"CUDA {torch.cuda.get_device_name()}: bandwidth of each Triton kernel vs a device-to-device copy")
    print(f"{'shape':>22} {'dtype':>9} {'copy GB/s':>10} {'stats':>7} {'fwd':>7} {'fwd+add':>8} {'bwd':>7} "
          f"{'bwd+add':>8}  (fraction of copy bandwidth)")
    for dtype in (torch.bfloat16, torch.float16):
        for shape in CUDA_SHAPES:
            y, w, b, r, g = make(shape, dtype, 'cuda', True)
            x, xr, xg = ops.as_rows(y), ops.as_rows(r), ops.as_rows(g)
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
            frac = {k: (n * nb / cuda_time(f, reps) / 1e6) / copy_bw for k, (f, n) in runs.items()}
            print(f"{str(list(shape)):>22} {str(dtype)[6:]:>9} {copy_bw:10.0f} " +
                  ' '.join(f"{frac[k]:{max(7, len(k))}.2f}" for k in runs))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', choices=['cpu', 'cuda', 'all'], default='all')
    p.add_argument('--reps', type=int, default=15)
    p.add_argument('--threads', type=int, default=None, help='CPU threads (default: torch\'s)')
    a = p.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    if a.device in ('cpu', 'all'): bench_cpu(a.reps)
    if a.device in ('cuda', 'all'):
        if torch.cuda.is_available(): bench_cuda(a.reps)
        else: print("CUDA: no GPU here; the CUDA benchmark did not run (Triton kernel speed unverified)")

if __name__ == '__main__': main()
