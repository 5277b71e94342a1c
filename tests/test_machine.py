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
    monkeypatch.setattr(machine, '_loaded_level', None)   # (as before this process loaded a library: the cap's rules)
    def use(flags, arch='x86_64'):
        monkeypatch.setattr(machine.platform, 'machine', lambda: arch)
        monkeypatch.setattr(machine, 'cpu_flags', lambda: frozenset(flags))
        level = machine.host_isa.__wrapped__()
        monkeypatch.setattr(machine, 'host_isa', lambda: level)
        return level
    return use

def test_a_cap_set_after_the_library_loaded_changes_nothing(monkeypatch):
    """`CLFAST_MAX_CPU_ISA` set after the C++ library loaded (in a notebook) changes no kernel: clfast's level, and the
    cache key of what its kernels measure, stay the loaded library's (they named the cap's, and the loaded kernels'
    timings were cached as that level's)"""
    from clfast import cpu_kernels
    if cpu_kernels.load() is None: pytest.skip("no C++ library here")
    level, key = clfast_isa(), machine_key()
    lower = CPU_LEVELS[0] if level != CPU_LEVELS[0] else None
    if lower is None: pytest.skip("the library runs at the lowest level already")
    monkeypatch.setenv(ISA_CAP_ENV, lower)
    assert clfast_isa() == level and machine_key() == key

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

def _child(code:str, env:dict|None=None, drop=(), **kw) -> subprocess.CompletedProcess:
    "Run `code` in a fresh Python (clfast importable), `env` over this one's minus the keys in `drop`"
    env = {k: v for k, v in {**os.environ, 'PYTHONPATH': str(ROOT), **(env or {})}.items() if k not in drop}
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT, **kw)

def test_concurrent_updates_lose_no_entry(tmp_path):
    """Two processes of two threads each updating one cache at once, started together: each read-merge-write holds the
    cache's lock, so every entry is kept (without it, one process's write replaced a file the other had just updated)"""
    code = textwrap.dedent("""
        import sys, threading; from clfast.machine import MachineCache
        print('ready', flush=True); sys.stdin.readline()
        def run(t):
            for i in range(50): MachineCache('race').update({f'{sys.argv[1]}{t}:{i}': i})
        ts = [threading.Thread(target=run, args=(t,)) for t in range(2)]
        for t in ts: t.start()
        for t in ts: t.join()""")
    env = {**os.environ, 'CLFAST_CACHE_DIR': str(tmp_path), 'PYTHONPATH': str(ROOT)}
    ps = [subprocess.Popen([sys.executable, '-c', code, tag], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT) for tag in 'ab']
    assert all(p.stdout.readline().strip() == 'ready' for p in ps)   # both started: they write at the same time
    for p in ps: p.stdin.write('\n'); p.stdin.flush()
    errs = [p.communicate(timeout=120)[1] for p in ps]
    assert all(p.returncode == 0 for p in ps), errs
    data = json.loads((tmp_path/'race.json').read_text())
    assert len(next(iter(data.values()))) == 200

def test_a_write_inside_the_measuring_lock_does_not_wait_for_itself(tmp_path, monkeypatch):
    "`decide` writes while it holds the measuring lock: the cache's own lock is another file, so nothing deadlocks"
    from clfast.timing import measuring
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(machine, 'LOCK_WAIT', 5.)
    c = machine.MachineCache('timings')
    with measuring(timeout=5):
        with measuring(timeout=5): c.update({'x': 1})
        c.clear().update({'y': 2})
    assert c.entries() == {'y': 2}

NO_PASSWD = textwrap.dedent("""
    import pwd
    def no_entry(uid): raise KeyError(f'getpwuid(): uid not found: {uid}')
    pwd.getpwuid = no_entry   # what a uid without a passwd entry sees (a container run as an arbitrary uid)
""")

def test_no_home_caches_in_the_temp_dir(tmp_path):
    "No $HOME and no passwd entry (Path.home() raises RuntimeError): the cache is `clfast-<uid>` in the temp dir, private"
    code = NO_PASSWD + textwrap.dedent("""
        import torch.nn as nn
        from clfast.machine import MachineCache, cache_dir
        from clfast.guard import guard_model
        guard_model(nn.Sequential(nn.Conv2d(3, 8, 3)))
        MachineCache('example').update({'a': 1})
        print(cache_dir(), MachineCache('example').entries())""")
    for _ in range(2):   # and a second process reads it
        p = _child(code, {'TMPDIR': str(tmp_path)}, drop=('HOME', 'XDG_CACHE_HOME', 'CLFAST_CACHE_DIR'))
        assert p.returncode == 0, p.stderr
    d = tmp_path/f'clfast-{os.getuid()}'
    assert p.stdout.split() == [str(d), "{'a':", '1}'] and (d.stat().st_mode & 0o777) == 0o700

@pytest.mark.skipif(os.geteuid() != 0, reason="makes a directory another user's (chown): needs root")
def test_no_home_trusts_no_other_users_temp_dir(tmp_path):
    "Where `clfast-<uid>` in a shared temp dir is another user's, the process keeps a private directory of its own"
    d = tmp_path/f'clfast-{os.getuid()}'
    d.mkdir(); os.chown(d, 54321, 54321)
    p = _child(NO_PASSWD + "from clfast.machine import cache_dir; print(cache_dir())", {'TMPDIR': str(tmp_path)},
               drop=('HOME', 'XDG_CACHE_HOME', 'CLFAST_CACHE_DIR'))
    assert p.returncode == 0, p.stderr
    got = Path(p.stdout.strip())
    assert got.parent == tmp_path and got != d and got.stat().st_uid == os.getuid() and (got.stat().st_mode & 0o777) == 0o700

def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """A write that fails (a full disk: here the file-size limit, EFBIG) is skipped and leaves the cache as it was, with
    no temporary file beside it; a value JSON cannot write raises and leaves none either"""
    code = """
        import os, resource, signal, json
        from clfast.machine import MachineCache
        c = MachineCache('full')
        c.update({'a': 1})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, hard))
        for i in range(3): c.update({f'k{i}': 'x' * 200})
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        try: c.update({'bad': {1, 2}})
        except TypeError: print('TypeError')
        print(json.dumps(c.entries()))"""
    p = _child(code, {'CLFAST_CACHE_DIR': str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split('\n')[:2] == ['TypeError', '{"a": 1}']
    assert sorted(os.listdir(tmp_path)) == ['full.json', 'full.json.lock']

def test_cache_file_has_the_umasks_mode(tmp_path, monkeypatch):
    "The cache file is made as any file of the user (0666 less the umask), not 0600: another user sharing the dir reads it"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    old = os.umask(0o027)
    try: machine.MachineCache('shared').update({'a': 1})
    finally: os.umask(old)
    assert (tmp_path/'shared.json').stat().st_mode & 0o777 == 0o640

def _without_dac_override():
    "Drop root's CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set: file modes then apply to it (after exec)"
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0): raise OSError(ctypes.get_errno(), 'PR_CAPBSET_DROP')   # PR_CAPBSET_DROP

def test_a_cache_it_cannot_read_is_never_overwritten(tmp_path):
    """Another user's cache file this process cannot read (EACCES, a real one: the file is another uid's, mode 0600): its
    entries are not taken for none and replaced by this process's; the write is skipped and the file kept as it was"""
    path = tmp_path/'timings.json'
    other = json.dumps({'some machine': {'theirs': 1}})
    path.write_text(other); path.chmod(0o600)
    if os.geteuid() == 0: os.chown(path, 54321, 54321)
    code = """
        from clfast.machine import MachineCache
        c = MachineCache('timings')
        try: c.path.read_text(); print('READABLE')
        except PermissionError: pass
        c.update({'mine': 1}); print(c.entries())"""
    p = _child(code, {'CLFAST_CACHE_DIR': str(tmp_path)}, preexec_fn=_without_dac_override if os.geteuid() == 0 else None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ['{}'] and path.read_text() == other

def test_isa_caps_are_read_once_per_process():
    """oneDNN and ATen read their caps once per process: clfast reads them once too (at its first question), so a cap
    changed later changes neither its oneDNN ISA nor the cache key; a cap set when the process starts is read"""
    code = """
        import os
        from clfast.machine import onednn_isa, machine_key, isa_env
        first = onednn_isa(), machine_key()
        os.environ['ONEDNN_MAX_CPU_ISA'] = 'SSE41'; os.environ['ATEN_CPU_CAPABILITY'] = 'default'
        print(first == (onednn_isa(), machine_key()), first[1])
        isa_env.cache_clear()   # what a test that changes a cap in its own process calls
        print(onednn_isa(), machine_key())"""
    p = _child(code, {'ONEDNN_MAX_CPU_ISA': 'AVX2'}, drop=('DNNL_MAX_CPU_ISA', 'ATEN_CPU_CAPABILITY'))
    assert p.returncode == 0, p.stderr
    same, cleared = p.stdout.strip().split('\n')
    assert same.startswith('True ') and 'ONEDNN_MAX_CPU_ISA=AVX2' in same and 'SSE41' not in same
    assert 'ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default' in cleared
    if machine.onednn_isa() is not None: assert cleared.split()[0] == 'sse41'

def test_machine_key_names_the_cpus_family_and_model():
    "A masked model name ('AMD EPYC' on Zen 4 and Zen 5 hosts): /proc/cpuinfo's family and model numbers tell them apart"
    info = machine._cpuinfo()
    for k, name in [('cpu family', 'family'), ('model', 'model')]:
        if info.get(k): assert f"{name} {info[k]}" in machine_key()

def test_cpu_id_tells_masked_names_apart(monkeypatch):
    zen4 = {'model name': 'AMD EPYC', 'cpu family': '25', 'model': '17', 'stepping': '0'}
    zen5 = {'model name': 'AMD EPYC', 'cpu family': '26', 'model': '2', 'stepping': '1'}
    graviton3 = {'CPU implementer': '0x41', 'CPU architecture': '8', 'CPU part': '0xd40'}
    ids, name = [], machine.cpu_name.__wrapped__
    monkeypatch.setattr(machine, 'cpu_name', name)   # (uncached: read from each `_cpuinfo` below)
    for info in (zen4, zen5, graviton3, {}):
        monkeypatch.setattr(machine, '_cpuinfo', lambda: info)
        ids.append(machine.cpu_id.__wrapped__())
    assert ids[:3] == ['AMD EPYC (family 25 model 17)', 'AMD EPYC (family 26 model 2)', f"{machine.cpu_name()} (implementer 0x41 part 0xd40)"]
    assert ids[3] == machine.cpu_name()
