#!/usr/bin/env python
"""CPU mixed precision: ResNet inference fp32 vs bf16 autocast, with oneDNN's native bf16 and with it capped to AVX2
(ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without AVX512-BF16), each in its own process. Ratios from one run."""
import argparse, json, os, subprocess, sys, time

CHILD = r'''
import json, sys, time, torch, torchvision
from torch.amp import autocast
torch.manual_seed(0)
arch, bs, px, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = getattr(torchvision.models, arch)().eval().to(memory_format=torch.channels_last)
x = torch.randn(bs, 3, px, px).contiguous(memory_format=torch.channels_last)
def run(bf16):
    with torch.no_grad(), autocast('cpu', dtype=torch.bfloat16, enabled=bf16): m(x)
times = {False: [], True: []}
for bf16 in (False, True): run(bf16); run(bf16)          # warm-up: oneDNN primitive creation
for _ in range(reps):
    for bf16 in (False, True):                           # interleaved, so both see the same machine load
        t = time.perf_counter(); run(bf16); times[bf16].append(time.perf_counter() - t)
med = lambda v: sorted(v)[len(v) // 2]
print(json.dumps(dict(fp32=med(times[False]), bf16=med(times[True]),
                      native=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))))
'''

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('--arch', default='resnet18'); p.add_argument('--bs', type=int, default=8)
    p.add_argument('--px', type=int, default=160); p.add_argument('--reps', type=int, default=7)
    a = p.parse_args(argv)
    print(f"{a.arch}, batch {a.bs}, {a.px} px, channels_last, CPU inference, {a.reps} interleaved reps (median)")
    for name, env in (('native oneDNN ISA', {}), ('ONEDNN_MAX_CPU_ISA=AVX2', {'ONEDNN_MAX_CPU_ISA': 'AVX2'})):
        out = subprocess.run([sys.executable, '-c', CHILD, a.arch, str(a.bs), str(a.px), str(a.reps)],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{name:<26} fp32 {r['fp32']*1e3:8.1f} ms   bf16 autocast {r['bf16']*1e3:8.1f} ms   "
              f"bf16/fp32 time {r['bf16']/r['fp32']:5.2f}x   (torch says bf16 native: {r['native']})")

if __name__ == '__main__': main()
