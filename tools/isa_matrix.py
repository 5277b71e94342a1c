"""Runs clfast's numerics tests at each instruction-set level below this CPU's own, so one machine tests the code of
the CPU kinds beneath it (an AVX-512 machine: the AVX2 and the generic code too). Each level is a fresh pytest run
with clfast's, ATen's and oneDNN's caps set (CLFAST_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA); the
levels come from this CPU's flags (clfast.machine), and the ones it cannot run are named. This CPU's own level is the
whole suite's run (tools/test.sh runs it after this). Exits 1 if any level fails, after running them all.

    python tools/isa_matrix.py            # every kind below this CPU's
    python tools/isa_matrix.py --list     # which would run, and which cannot here

On the project's 2-core AVX-512 machine a kind's tests took 1.5-4 minutes (with the machine's load), plus 1.5 to build
clfast's kernels at its level.
"""
import os, re, subprocess, sys, time, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clfast.machine import CPU_LEVELS, cpu_flags, host_isa   # noqa: E402

# The numerics tests: the C++ kernels, the fused layer, the op and its backends, the guard, the precision policy, the
# precise BatchNorm (its premise is measured per level). Not the Triton interpreter's (numpy, the same at every level),
# nor the cuda-marked ones, nor those marked isa_neutral (child processes, packaging, messages: 45 s a level on Zen 3).
TESTS = ['tests/test_cpu_backend.py', 'tests/test_fused.py', 'tests/test_ops.py', 'tests/test_guard.py',
         'tests/test_precision.py', 'tests/test_bn.py']
DESELECT = ['-k', 'not triton', '-m', 'not isa_neutral']

# A CPU kind: clfast's level, ATen's capability, oneDNN's ISA cap, what oneDNN then says it runs (its verbose "isa:"
# line), and the features a CPU of this level needs beyond the level to run this kind below its own.
KINDS = [
    dict(name='generic', clfast='generic', aten='default', onednn='SSE41', says='SSE4.1', beyond=set(),
         cpus='x86-64 without AVX2'),
    dict(name='avx2', clfast='avx2', aten='avx2', onednn='AVX2', says='AVX2', beyond=set(),
         cpus='AVX2: Haswell to Alder Lake, Zen 1-3'),
    # AVX-512 without VNNI/BF16: clfast's and ATen's AVX-512 code with oneDNN's plain AVX-512 kernels (bf16 emulated);
    # below any AVX-512 CPU that has more
    dict(name='avx512-core', clfast='avx512', aten='avx512', onednn='AVX512_CORE', says='AVX512DQ extensions',
         beyond={'avx512_vnni', 'avx512_bf16', 'avx512_fp16', 'amx_tile'}, cpus='AVX-512 without VNNI/BF16: Skylake-SP/X'),
]

PROBE = """
import torch, torch.nn.functional as F
from clfast.machine import clfast_isa
print('ATEN', torch.backends.cpu.get_cpu_capability().lower(), 'CLFAST', clfast_isa(), flush=True)
x = torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last)
F.conv2d(x, torch.randn(16, 16, 3, 3).to(memory_format=torch.channels_last))   # oneDNN prints its ISA at its first conv
"""

def env_of(kind:dict) -> dict:
    return {'CLFAST_MAX_CPU_ISA': kind['clfast'], 'ATEN_CPU_CAPABILITY': kind['aten'], 'ONEDNN_MAX_CPU_ISA': kind['onednn']}

def plan() -> tuple[list, list]:
    "(kinds to run here, [(kind, why not)]): a kind runs when this CPU has its level and it is below this CPU's own"
    host, flags, run, skip = host_isa(), cpu_flags(), [], []
    for k in KINDS:
        lvl, top = CPU_LEVELS.index(k['clfast']), CPU_LEVELS.index(host)
        if lvl > top: skip.append((k, f"this CPU's level is {host}"))
        elif lvl == top and not (flags & k['beyond']): skip.append((k, "it is this CPU's own level (the whole suite runs it)"))
        else: run.append(k)
    return run, skip

def describe(k:dict) -> str:
    return f"{k['name']} ({k['cpus']}; {' '.join(f'{a}={b}' for a, b in env_of(k).items())})"

def run_kind(k:dict, env:dict) -> tuple[bool, str]:
    "Check the caps take effect, then run the numerics tests under them; (passed, the summary)"
    probe = subprocess.run([sys.executable, '-c', PROBE], env={**env, 'ONEDNN_VERBOSE': '1'}, capture_output=True,
                           text=True, cwd=ROOT, timeout=600)
    isa = re.search(r'info,cpu,isa:(.*)', probe.stdout)
    want = f"ATEN {k['aten']} CLFAST {k['clfast']}"
    if probe.returncode != 0 or want not in probe.stdout or not isa or k['says'] not in isa.group(1):
        return False, (f"the caps did not take effect: want '{want}' and oneDNN's ISA '{k['says']}', got "
                       f"{probe.stdout[-2000:]}{probe.stderr[-2000:]}")
    p = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *DESELECT, *TESTS],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0: return True, f"oneDNN: {isa.group(1)}; {lines[-1] if lines else ''}"
    # the failures' report (pytest's tracebacks and its short summary), not the progress dots
    start = next((i for i, l in enumerate(lines) if l.startswith('=')), max(0, len(lines) - 200))
    return False, '\n'.join(lines[start:]) + p.stderr[-3000:]

def main(argv:list) -> int:
    run, skip = plan()
    print(f"isa matrix: this CPU's level is {host_isa()}; below it this runs {', '.join(k['name'] for k in run) or 'nothing'}")
    for k, why in skip: print(f"isa matrix: not run here: {describe(k)}: {why}")
    if '--list' in argv: return 0
    failed = []
    for k in run:
        t0 = time.perf_counter()
        env = {**os.environ, **env_of(k), 'PYTHONPATH': os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get('PYTHONPATH')] if p])}
        # inductor's own cache per kind: its keys leave ATEN_CPU_CAPABILITY out, so a kernel generated with AVX-512
        # vectors was reused under ATEN_CPU_CAPABILITY=default and failed to compile ("'at::vec' has not been declared")
        with tempfile.TemporaryDirectory(prefix=f"clfast-inductor-{k['name']}-") as cache:
            ok, summary = run_kind(k, {**env, 'TORCHINDUCTOR_CACHE_DIR': cache})
        print(f"isa matrix: {describe(k)}: {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
        print(('  ' if ok else '') + summary, flush=True)
        if not ok: failed.append(k['name'])
    if failed: print(f"FAIL: isa matrix: the numerics tests failed at {', '.join(failed)}")
    return 1 if failed else 0

if __name__ == '__main__': sys.exit(main(sys.argv[1:]))
