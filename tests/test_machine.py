"""clfast.machine: the CPU's instruction-set level, clfast's level under the CLFAST_MAX_CPU_ISA cap (and its bad
values), and the per-machine key that caches of measurements use."""
import json, os, subprocess, sys, textwrap, warnings
from pathlib import Path
import pytest
from clfast import machine
from clfast.core import ClfastWarning
from clfast.machine import CPU_LEVELS, LEVEL_FLAGS, ISA_CAP_ENV, CpuIsaError, clfast_isa, machine_key

ROOT = Path(__file__).parent.parent
AVX2 = {'sse4_2', 'avx', 'avx2', 'fma', 'f16c'}
AVX512 = AVX2 | {'avx512f', 'avx512bw', 'avx512dq', 'avx512vl', 'avx512cd'}

@pytest.fixture
def host(monkeypatch):
    "Make clfast see an x86 CPU with these /proc/cpuinfo flags (the level's rules, whatever CPU runs the test)"
    monkeypatch.delenv(ISA_CAP_ENV, raising=False)
    monkeypatch.setattr(machine, '_warned_caps', set())
    def use(flags, arch='x86_64'):
        monkeypatch.setattr(machine.platform, 'machine', lambda: arch)
        monkeypatch.setattr(machine, 'cpu_flags', lambda: frozenset(flags))
        level = machine.host_isa.__wrapped__()
        monkeypatch.setattr(machine, 'host_isa', lambda: level)
        return level
    return use

@pytest.mark.parametrize('flags,level', [
    (AVX512 | {'avx512_bf16', 'amx_tile'}, 'avx512'), (AVX512, 'avx512'),
    (AVX2 | {'avx512f', 'avx512cd'}, 'avx2'),          # AVX-512 without BW/DQ/VL (Xeon Phi): ATen's AVX-512 needs them
    (AVX2, 'avx2'), (AVX2 - {'fma'}, 'generic'), (AVX2 - {'f16c'}, 'generic'), ({'sse4_2'}, 'generic')])
def test_host_level_from_flags(host, flags, level):
    assert host(flags) == level

def test_not_x86_is_generic(host):
    assert host(AVX512, arch='aarch64') == 'generic'

def test_levels_nest():
    "Each level's code may use the instructions of the ones below it"
    assert CPU_LEVELS == ('generic', 'avx2', 'avx512')
    assert all(LEVEL_FLAGS[a] < LEVEL_FLAGS[b] for a, b in zip(CPU_LEVELS, CPU_LEVELS[1:]))

def test_cap_lowers_the_level_in_any_case(host, monkeypatch):
    host(AVX512)
    assert clfast_isa() == 'avx512'
    for cap, level in [('AVX2', 'avx2'), ('avx2', 'avx2'), (' Generic ', 'generic'), ('avx512', 'avx512'), ('', 'avx512')]:
        monkeypatch.setenv(ISA_CAP_ENV, cap)
        assert clfast_isa() == level

@pytest.mark.parametrize('cap', ['avx3', 'native', 'default', 'AVX512_CORE'])
def test_unknown_cap_is_an_error_listing_the_levels(host, monkeypatch, cap):
    host(AVX2)
    monkeypatch.setenv(ISA_CAP_ENV, cap)
    with pytest.raises(CpuIsaError, match=f"{ISA_CAP_ENV}='{cap}' is not a clfast CPU level.*generic, avx2, avx512"):
        clfast_isa()

def test_cap_above_the_host_runs_at_the_hosts_level_with_one_warning(host, monkeypatch):
    host(AVX2)
    monkeypatch.setenv(ISA_CAP_ENV, 'AVX512')
    with pytest.warns(ClfastWarning, match="CLFAST_MAX_CPU_ISA=AVX512 is above this CPU's level: clfast runs at the host's level avx2"):
        assert clfast_isa() == 'avx2'
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert clfast_isa() == 'avx2'      # said once

def test_machine_key_names_clfasts_level(host, monkeypatch):
    "Measurements cached per machine are kept apart per kernel level"
    host(AVX512)
    keys = set()
    for cap in CPU_LEVELS:
        monkeypatch.setenv(ISA_CAP_ENV, cap)
        assert f"clfast={cap}" in machine_key()
        keys.add(machine_key())
    assert len(keys) == 3

def test_bad_cap_stops_the_fused_layer():
    "A misspelt cap is raised where the kernels load, not turned into the slow pure-PyTorch path with a warning"
    code = textwrap.dedent("""
        import torch
        from clfast.fused import FusedConvBN2d
        from clfast.machine import CpuIsaError
        try: FusedConvBN2d(3, 4, 3, padding=1)(torch.randn(2, 3, 5, 5))
        except CpuIsaError as e: print('RAISED', e)""")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{ISA_CAP_ENV: 'avx-512'})
    p = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0 and 'RAISED' in p.stdout and 'generic, avx2, avx512' in p.stdout, p.stdout + p.stderr

def _isa_matrix():
    import importlib.util
    spec = importlib.util.spec_from_file_location('isa_matrix', ROOT/'tools'/'isa_matrix.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

@pytest.mark.parametrize('flags,arch,runs', [
    (AVX512 | {'avx512_bf16', 'avx512_vnni'}, 'x86_64', ['generic', 'avx2', 'avx512-core']),
    (AVX512, 'x86_64', ['generic', 'avx2']),            # Skylake-X: oneDNN's AVX512_CORE is its own
    (AVX2, 'x86_64', ['generic']), ({'sse4_2'}, 'x86_64', []), (AVX512, 'aarch64', [])])
def test_isa_matrix_runs_the_levels_below_the_host(host, monkeypatch, flags, arch, runs):
    "CI's matrix (tools/isa_matrix.py) derives its levels from the CPU, and names each one it cannot run"
    m = _isa_matrix()
    host(flags, arch)
    monkeypatch.setattr(m, 'host_isa', machine.host_isa); monkeypatch.setattr(m, 'cpu_flags', machine.cpu_flags)
    run, skip = m.plan()
    assert [k['name'] for k in run] == runs
    assert sorted(k['name'] for k, why in skip) == sorted(set(k['name'] for k in m.KINDS) - set(runs)) and all(w for _, w in skip)

@pytest.mark.parametrize('text', ['', '{"torch', '\x00\xff garbage', '[1, 2]', 'null', '{"%KEY%": [1, 2]}', '{"%KEY%": "x"}'])
def test_a_broken_cache_is_measured_again(text, tmp_path, monkeypatch):
    "A cache file truncated, corrupted or holding something else: its premises are probed again and written back whole"
    from clfast import routes, timing
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})   # as a fresh process: the file is read
    cache = timing._TimingCache(timing.TIMINGS)
    cache.path.write_text(text.replace('%KEY%', cache.key()))
    probed = []
    assert routes.premise('p', lambda: probed.append(1) or True) is True and probed == [1]
    timing._here.clear()
    assert routes.premise('p', lambda: probed.append(1) or False) is True and probed == [1]   # read back, not probed
    assert json.loads(cache.path.read_text())[cache.key()] == {'premise:p': True}

def test_two_processes_writing_one_cache(tmp_path):
    "Two processes updating one cache at once: every read in either sees a whole file (a lost update is measured again)"
    code = ("import sys; from clfast.machine import MachineCache\n"
            "c = MachineCache('race')\n"
            "for i in range(200):\n"
            "    c.update({f'{sys.argv[1]}{i}': i}); assert isinstance(c.entries(), dict)\n")
    env = {**os.environ, 'CLFAST_CACHE_DIR': str(tmp_path)}
    ps = [subprocess.Popen([sys.executable, '-c', code, tag], env=env, stderr=subprocess.PIPE, text=True) for tag in 'ab']
    errs = [p.communicate()[1] for p in ps]
    assert all(p.returncode == 0 for p in ps), errs
    data = json.loads((tmp_path/'race.json').read_text())
    assert len(data) == 1 and all(isinstance(v, int) for v in next(iter(data.values())).values())
