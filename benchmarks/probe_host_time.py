"""Where a fused layer step's host time goes on a GPU (issue 34 item 2: within 1.2x stock's; the H200 measured 1.5-1.9x
in session 55): each step's host issue time (no sync inside), a synchronization caught by
`torch.cuda.set_sync_debug_mode('error')` with its Python stack, the CUDA runtime calls a step makes
(torch.profiler's CPU side), and the Python functions' own time (cProfile), the fused way (Triton's launches, both
ways) against the stock modules'; first, one launch's host time each way (Triton's own, through the compiled kernel)
against an ATen kernel's.

    python benchmarks/probe_host_time.py [--shape 2 64 1 1] [--steps 200]
    python benchmarks/probe_host_time.py --device cpu --steps 20   # the script's own dry run (the C++ op, no Triton)
"""
import argparse, contextlib, cProfile, io, pstats, statistics, sys, time, traceback
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository's clfast (the GPU machine installs none)
import torch
from torch.profiler import profile, ProfilerActivity
from clfast import triton_kernels as tk
from clfast.fused import set_layer_way
from clfast.host_cost import fused_step, stock_step

def _sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)

def issue_us(step, device, k:int=20, reps:int=15) -> float:
    "Median host time to issue one step, `k` steps back to back between synchronizations"
    times = []
    for _ in range(reps):
        _sync(device); t = time.perf_counter()
        for _ in range(k): step()
        times.append((time.perf_counter() - t) / k)
    _sync(device)
    return statistics.median(times) * 1e6

def first_sync(step, device) -> str:
    "The Python stack of the first synchronizing CUDA call in a step, or 'none'"
    if device.type != 'cuda': return 'not a CUDA device'
    torch.cuda.set_sync_debug_mode('error')
    try: step()
    except RuntimeError as e:
        return ''.join(traceback.format_exception(e)[-14:])
    finally: torch.cuda.set_sync_debug_mode('default')
    return 'none'

def runtime_calls(step, device, n:int=10) -> str:
    "The CUDA runtime / driver calls of a step (torch.profiler's CPU side), per step: count and host us"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with profile(activities=acts) as p:
        for _ in range(n): step()
        _sync(device)
    rows = [(e.key, e.count / n, e.self_cpu_time_total / n) for e in p.key_averages()
            if e.key.startswith(('cuda', 'cu')) and not e.key.startswith('cudnn')]
    rows.sort(key=lambda r: -r[2])
    return '\n'.join(f"    {us:8.1f} us  x{cnt:5.1f}  {key}" for key, cnt, us in rows[:12]) or '    (none)'

def python_time(step, n:int, rows:int=28) -> str:
    "cProfile's own time per function over `n` steps, per step"
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): step()
    pr.disable()
    s = io.StringIO(); st = pstats.Stats(pr, stream=s)
    out = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:rows]:
        out.append(f"    {tt / n * 1e6:8.1f} us own {ct / n * 1e6:8.1f} us cum  x{nc / n:5.1f}  {Path(file).name}:{line}({fn})")
    return '\n'.join(out)

def launch_us(device, reps:int) -> str:
    """The host time of one launch of a Triton kernel (the forward's apply pass on a 2x64x1x1 map: 7 arguments, 5 of
    them tensors), each launch way, against an ATen kernel's (`add_`), 200 launches back to back between
    synchronizations: what a layer step's four launches cost apart from the rest of its Python"""
    if device.type != 'cuda': return "# one launch: needs a CUDA device (Triton launches)"
    y = torch.randn(2, 64, 1, 1, device=device).to(memory_format=torch.channels_last)
    prm, out = torch.randn(5, 64, device=device), torch.empty_like(y)
    k = tk._consts(0., 1e-5, torch.float32, device)
    fwd = lambda: tk._fwd_into(y, 2, prm, None, k, 1, out)
    rows = []
    for way in tk.LAUNCH_WAYS:
        with tk.launching(way):
            for _ in range(5): fwd()   # compiled, keyed
            rows.append(f"# one launch: Triton _fwd, {way}: {issue_us(fwd, device, k=200, reps=reps):.1f} us")
    rows.append(f"# one launch: ATen add_: {issue_us(lambda: out.add_(1.), device, k=200, reps=reps):.1f} us")
    return '\n'.join(rows)

def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a.add_argument('--device', default='cuda')
    a.add_argument('--shape', nargs=4, type=int, default=[2, 64, 1, 1], help="N C H W of the layer step (tiny: the host's time alone)")
    a.add_argument('--steps', type=int, default=200, help="steps cProfile'd per way")
    a.add_argument('--dtypes', nargs='+', default=['bfloat16', 'float32'])
    a.add_argument('--reps', type=int, default=15, help="timings of the issue time, each of 20 steps back to back")
    args = a.parse_args(argv)
    device, shape = torch.device(args.device), tuple(args.shape)
    if device.type == 'cuda':
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, layer step {shape}", flush=True)
    print(launch_us(device, args.reps), flush=True)
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        ways = {'stock modules': (stock_step(dtype, 'relu', True, shape, device=device), 'fused', contextlib.nullcontext),
                'fused, Triton jit launch': (fused_step(dtype, 'relu', True, 'speed', shape, device=device), 'fused', contextlib.nullcontext),
                'fused, compiled launch': (fused_step(dtype, 'relu', True, 'speed', shape, device=device), 'fused',
                                           lambda: tk.launching('compiled')),
                "fused module's stock way": (fused_step(dtype, 'relu', True, 'speed', shape, device=device), 'stock', contextlib.nullcontext)}
        for name, (step, way, launching) in ways.items():
            prev = set_layer_way(way)
            try:
                with launching():
                    for _ in range(5): step()   # compiles, first allocations, the compiled kernels' table
                    _sync(device)
                    print(f"\n## {dt} conv-BN-add-relu, {name}: host issue {issue_us(step, device, reps=args.reps):.0f} us a step",
                          flush=True)
                    print("  first synchronizing call:", first_sync(step, device))
                    print("  CUDA runtime calls a step:\n" + runtime_calls(step, device), flush=True)
                    print("  Python's own time a step (cProfile):\n" + python_time(step, args.steps), flush=True)
            finally: set_layer_way(prev)

if __name__ == '__main__': main()
