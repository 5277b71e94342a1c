"""clfast.timing, the one way clfast times a choice: the stopping rule on scripted timings (a clock that advances by
what each call is said to take), and the measuring lock and the shared cache between real processes"""
import contextlib, copy, itertools, json, os, subprocess, sys, textwrap, time
import pytest, torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
from clfast import timing
from clfast.timing import time_pair, decide, Timing, MARGIN, MIN_PAIRS, MAX_PAIRS

class Script:
    "A clock and two calls: each call advances the clock by its scripted duration (the first, a warm-up's, 9.0; then cycling through the list)"
    def __init__(self, default, candidate): self.now, self.d, self.c, self.n = 0., default, candidate, {'d': 0, 'c': 0}
    def clock(self): return self.now
    def call(self, which, times):
        def f():
            n = self.n[which]; self.n[which] += 1
            self.now += 9.0 if n == 0 else times[(n - 1) % len(times)]
        return f
    def run(self, **kw): return time_pair(self.call('d', self.d), self.call('c', self.c), clock=self.clock, **kw)

@pytest.mark.parametrize('candidate,faster,pairs,full_pairs', [
    ([0.5], True, MIN_PAIRS, MIN_PAIRS),                  # clearly faster: the fewest pairs settle it
    ([1.5], False, 3, MIN_PAIRS),                         # clearly slower: hopeless at its third pair above the margin
    ([MARGIN], True, MIN_PAIRS, MIN_PAIRS),               # at the margin counts as faster by it
    ([0.9, 1.05], False, 6, MAX_PAIRS),                   # a tie within noise (full: undecided when the pairs run out)
    ([1.0, 1.0, 0.8], False, 4, MAX_PAIRS),               # 1 in 3 below (full: neither side significant in 12 pairs)
])
def test_pairs_are_added_until_the_sign_test_decides(candidate, faster, pairs, full_pairs):
    """The decision follows the pairs' ratios (the default takes 1.0), not one noisy pair; a candidate that can no longer
    be chosen stops at once, not faster (the default kept, as the whole run keeps it); `full_verdict` runs the sign test
    to its verdict, and a tie is said to be one"""
    t = Script([1.0], candidate).run()
    assert (t.faster, t.pairs) == (faster, pairs), t
    assert t.chosen == (faster is True) and t.default_s == 1.0
    full = Script([1.0], candidate).run(full_verdict=True)
    assert (full.faster, full.pairs) == (None if full_pairs == MAX_PAIRS else faster, full_pairs), full
    assert full.chosen == t.chosen

def test_hopeless_stops_only_where_the_whole_run_would_not_choose():
    """Every sequence of `MAX_PAIRS` ratios above or below the margin: `hopeless` stops a run only after the sign test
    chose the candidate (where the run has ended already) or where it never would, and it stops every run that ends
    unchosen"""
    for above in itertools.product([False, True], repeat=MAX_PAIRS):
        rs = [1.0 if a else 0.5 for a in above]
        stop = next((n for n in range(1, MAX_PAIRS + 1) if timing.hopeless(rs[:n])), None)
        chosen_at = next((n for n in range(MIN_PAIRS, MAX_PAIRS + 1) if timing.verdict(rs[:n]) is True), None)
        if stop is None: assert chosen_at is not None, rs
        else: assert chosen_at is None or chosen_at < stop, rs

def test_give_up_ends_a_hopeless_candidate_at_once():
    t = Script([1.0], [30.0, 1.0]).run(give_up=20.)
    assert (t.faster, t.pairs, t.ratio) == (False, 1, 30.0)

_CHILD = textwrap.dedent('''
    import sys, time
    from clfast import timing
    timing.BUSY_TRIES = 1   # kept whatever load the machine has meanwhile: decisions timed under load are tested apart
    def measure():
        open(sys.argv[2], 'a').write(sys.argv[1] + ' start %f\\n' % time.time()); time.sleep(1.0)
        open(sys.argv[2], 'a').write(sys.argv[1] + ' end %f\\n' % time.time())
        return timing.Timing(0.5, 6, True, 1e-3)
    print(timing.decide('test:shared', measure).chosen, timing.decide('test:other' + sys.argv[1], measure).chosen)
''')

def test_processes_measure_one_at_a_time_and_share_answers(tmp_path, monkeypatch):
    """Three processes decide one shared choice and one each at once: the shared one is measured once (the others wait
    for the lock, then read its answer), and no two measurements overlap in time"""
    log = tmp_path/'log'
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, '-c', _CHILD, str(i), str(log)], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(3)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs == [['True', 'True']] * 3
    events = sorted((float(t), who, what) for who, what, t in (l.split() for l in log.read_text().splitlines()))
    assert len(events) == 2 * 4                               # 1 shared + 3 own measurements
    for (t0, a, s), (t1, b, e) in zip(events[::2], events[1::2]):   # start, end, start, end, ...: never two at once
        assert (s, e, a) == ('start', 'end', b)
    cache = timing._TimingCache(timing.TIMINGS)
    entries = json.loads(cache.path.read_text())[cache.key()]
    assert set(entries) == {'test:shared', 'test:other0', 'test:other1', 'test:other2'}

def test_a_process_that_waits_too_long_measures_for_itself(tmp_path, monkeypatch):
    """Another process holds the measuring lock past the timeout (stopped in a debugger): this one measures for itself
    alone, caches nothing, says so once, and waits no more. It kept the default, and for a premise of a stock kernel's
    numerics that is the kernel it may find wrong; each premise waited the timeout in turn (a guarded model asks 4-5)"""
    import fcntl, warnings
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {}); monkeypatch.setattr(timing, 'LOCK_TIMEOUT', 2.)
    monkeypatch.setattr(timing, '_waited', False)
    holder = subprocess.Popen([sys.executable, '-c', textwrap.dedent(f'''
        import fcntl, os, sys, time
        fd = os.open({str(tmp_path/'measuring.lock')!r}, os.O_CREAT | os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX)
        print('held', flush=True); time.sleep(30)''')], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            t0 = time.monotonic()
            assert decide('test:wrong_kernel', lambda: True) is True
            t1 = time.monotonic()
            assert decide('test:another', lambda: False) is False
            t2 = time.monotonic()
        assert t1 - t0 >= 2. and t2 - t1 < 1., (t1 - t0, t2 - t1)
        said = [str(m.message) for m in w if 'measuring lock' in str(m.message)]
        assert len(said) == 1 and 'for itself alone (nothing cached)' in said[0], said
        assert not {'test:wrong_kernel', 'test:another'} & set(timing._TimingCache(timing.TIMINGS).entries())
    finally: holder.kill(); holder.communicate()

def test_a_premise_is_measured_with_onednn_on(tmp_path, monkeypatch):
    """A premise is about the machine's kernels as a process runs them: asked first under
    `torch.backends.mkldnn.flags(enabled=False)`, the narrow-map probe ran ATen's bf16 weight gradient instead of
    oneDNN's, and cached for every later process that oneDNN's was not wrong (on this Zen 4 it is: 1e21 off fp64)"""
    from clfast.routes import NARROW_WEIGHT_GRAD_WRONG, HALF_DTYPES
    kernel = NARROW_WEIGHT_GRAD_WRONG[HALF_DTYPES[0]]
    answers = []
    for onednn in (True, False):
        monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path/str(onednn)))
        monkeypatch.setattr(timing, '_here', {})
        with torch.backends.mkldnn.flags(enabled=onednn):
            answers.append(kernel.present())
            assert torch.backends.mkldnn.enabled == onednn   # the caller's flag, back
    assert answers[0] == answers[1], answers

def test_another_versions_cache_is_ignored_and_said_once(tmp_path, monkeypatch):
    import warnings
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {}); monkeypatch.setattr(timing, '_said', set())
    cache = timing._TimingCache(timing.TIMINGS)
    cache.path.write_text(json.dumps({cache.key().replace('clfast ', 'clfast 0.0.'): {'test:x': dict(ratio=0.1, pairs=6, faster=True, default_s=1.)}}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        t1 = decide('test:x', lambda: Timing(2., 6, False, 1.))
        t2 = decide('test:y', lambda: Timing(2., 6, False, 1.))
    assert not t1.chosen and not t2.chosen                      # measured here, not read from the other version's
    assert sum("another clfast version's" in str(m.message) for m in w) == 1

_BACKWARD_CHILD = textwrap.dedent('''
    import sys, torch
    from clfast import cpu_kernels, timing
    if sys.argv[1] == 'again': timing.time_pair = lambda *a, **k: sys.exit('timed again')   # a second process reads the cache
    timing.BUSY_TRIES = 1   # kept whatever load the machine has meanwhile: decisions timed under load are tested apart
    cpu_kernels.load(); cpu_kernels.set_gemm_backward('timed')
    x = torch.randn(3, 20, 5, 7).to(memory_format=torch.channels_last)   # as a backward sees them: no grad recorded
    w = torch.randn(12, 20, 1, 1).to(memory_format=torch.channels_last)
    out = torch.ops.clfast_cpu.stock_conv_backward(torch.randn(3, 12, 5, 7).to(memory_format=torch.channels_last), x, w,
                                                   None, [1, 1], [0, 0], [1, 1], 1, [True, True, False])
    print(cpu_kernels.BACKWARD_WAYS[out[3]], [k.split()[-1] + ':' + str(t.chosen) for k, t in timing.timings('conv_backward:').items()])
''')

def test_cpp_backward_choice_is_timings_once_per_machine(tmp_path):
    """The C++ library's per-shape choice of a conv backward (ATen's or matrix products) is clfast.timing's: it asks
    Python, whose decision is cached for the machine, so a second process runs the same way without timing it"""
    from clfast.ops import kernels_ready
    if not kernels_ready() : pytest.skip("no C++ library here")
    env = {**os.environ, 'CLFAST_CACHE_DIR': str(tmp_path)}
    first, again = (subprocess.run([sys.executable, '-c', _BACKWARD_CHILD, which], env=env, capture_output=True, text=True)
                    for which in ('first', 'again'))
    assert first.returncode == 0 and again.returncode == 0, first.stderr[-2000:] + again.stderr[-2000:]
    way, decided = first.stdout.split(maxsplit=1)
    assert decided.strip() in ("['gemm:True']", "['gemm:False']")
    assert way == ('gemm' if 'True' in decided else 'conv') and again.stdout == first.stdout

def test_a_decision_is_this_processs_at_the_thread_count_it_runs_now(tmp_path, monkeypatch):
    """The file keys decisions by the thread count (`machine_key`), and so does this process after
    `torch.set_num_threads`: channels-last BN's precision premise (`clfast.bn`) held on 1 thread and not on 32, and a
    process that first asked on 32 threads kept it False on 1, its BNs stock there (38x contiguous's error against
    fp64). A premise probed on each count, each answer read back from the process's or the file's, not probed again"""
    from clfast.routes import premise
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {}); monkeypatch.setattr(timing, '_here_threads', {})
    probed = []
    def probe():   # holds on one thread only, as the BN premise's numerics may
        probed.append(torch.get_num_threads())
        return torch.get_num_threads() == 1
    threads = torch.get_num_threads()
    try:
        answers = []
        for n in (4, 1, 4, 1):
            torch.set_num_threads(n)
            answers.append(premise('test_threads', probe))
    finally: torch.set_num_threads(threads)
    assert answers == [False, True, False, True] and probed == [4, 1]
    # `clfast check`'s report names its thread count, and the others the cache holds decisions at (it said "none yet")
    try:
        torch.set_num_threads(3)
        head = timing.report().splitlines()[:3]
    finally: torch.set_num_threads(threads)
    assert 'on this machine at 3 threads' in head[0] and '(also cached at 1, 4 threads: OMP_NUM_THREADS=1 ' in head[1]
    assert head[2].endswith('none yet: each is measured when first needed'), head

# a decision timed beside a busy loop on each core (the machine's others' load), then held until told to end
_LOADED_CHILD = textwrap.dedent('''
    import os, subprocess, sys, time
    from clfast import timing
    def measure():
        hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(os.cpu_count())]
        try: time.sleep(1.0)
        finally:
            for h in hogs: h.kill(); h.wait()
        return timing.Timing(0.5, 6, True, 1e-3)
    print(timing.decide('test:loaded', measure).chosen, flush=True)
    sys.stdin.readline()
''')

def test_a_decision_timed_under_load_is_timed_again_once_its_process_ended(tmp_path, monkeypatch):
    """A decision measured while other processes kept the cores busy is marked so; processes running beside the one
    that measured it read its answer (ranks started together share one), and the first process to ask after it ended
    measures again (its answer, not the loaded one's)"""
    from clfast.machine import this_process
    if this_process() is None: pytest.skip("no /proc: no process can tell whether another runs")
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    child = subprocess.Popen([sys.executable, '-c', _LOADED_CHILD], env=dict(os.environ), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try: assert child.stdout.readline().strip() == 'True'
    finally: child.stdin.close()   # (the child ends at once where the assertion failed)
    entry = timing._TimingCache(timing.TIMINGS).get('test:loaded')
    assert entry['busy'] > timing.BUSY_SHARE and entry['tries'] == 1, entry
    child.wait(timeout=60)
    measured = []
    def measure():
        measured.append(1)
        return Timing(2., 6, False, 1e-3)
    t = decide('test:loaded', measure)
    assert measured == [1] and not t.chosen   # measured again: the loaded answer was True
    entry = timing._TimingCache(timing.TIMINGS).get('test:loaded')
    assert 'by' not in entry or entry['tries'] == 2, entry   # quiet here: kept for good; loaded again: counted

def test_a_running_processs_loaded_decision_is_shared(tmp_path, monkeypatch):
    "While the process that measured a decision under load runs, another reads its answer rather than measuring again"
    from clfast.machine import this_process
    if this_process() is None: pytest.skip("no /proc: no process can tell whether another runs")
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    child = subprocess.Popen([sys.executable, '-c', _LOADED_CHILD], env=dict(os.environ), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == 'True'
        assert 'by' in timing._TimingCache(timing.TIMINGS).get('test:loaded')
        assert decide('test:loaded', lambda: pytest.fail('measured while its measurer runs')).chosen
    finally: child.stdin.close(); child.wait(timeout=60)

def test_the_last_measurement_under_load_is_kept(tmp_path, monkeypatch):
    """After `BUSY_TRIES` measurements under load the last is kept for good: a machine always that busy is the machine.
    Here a decision measured under load twice by processes that ended (a pid's earlier process: another start time) is
    measured a third time under load, and kept"""
    from clfast.machine import this_process
    me = this_process()
    if me is None: pytest.skip("no /proc: no process can tell whether another runs")
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    ns, pid, start = me.split(':')
    ended = f"{ns}:{pid}:{int(start) - 1}"
    cache = timing._TimingCache(timing.TIMINGS)
    cache.update({'test:busy': dict(ratio=0.5, pairs=6, faster=True, default_s=1e-3, busy=0.9, by=ended,
                                    tries=timing.BUSY_TRIES - 1)})
    def measure():
        hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(os.cpu_count())]
        try: time.sleep(1.0)
        finally:
            for h in hogs: h.kill(); h.wait()
        return Timing(2., 6, False, 1e-3)
    assert not decide('test:busy', measure).chosen
    assert cache.get('test:busy') == dict(ratio=2., pairs=6, faster=False, default_s=1e-3)

def test_an_unwritable_cache_still_decides(tmp_path, monkeypatch):
    """No writable cache directory (a read-only home in a container): the decision is measured and kept for this
    process, nothing raises, and that every process will measure again is said once, with what to set (it was silent)"""
    import warnings
    from clfast import machine
    (tmp_path/'file').write_text('')
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path/'file'/'cache'))   # under a file: no directory can be made
    monkeypatch.setattr(timing, '_here', {}); monkeypatch.setattr(machine, '_unwritable', set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        t = decide('test:nowhere', lambda: Timing(0.5, 6, True, 1.))
        assert t.chosen and decide('test:nowhere', lambda: pytest.fail('measured twice')) is t
        decide('test:nowhere either', lambda: Timing(0.5, 6, True, 1.))
    said = [str(m.message) for m in w if 'cannot use its cache' in str(m.message)]
    assert len(said) == 1 and 'CLFAST_CACHE_DIR' in said[0], said

@pytest.mark.cuda
def test_device_clock_reads_the_gpus_time_not_the_hosts():
    """`DeviceClock` reads what a CUDA graph's replay would take: the host's time between two tiny kernels is not in it,
    a large matrix product's GPU time is; a call the host issued over longer than the sleep is said (`overran`) and
    lengthens the sleep after it"""
    import torch
    a, m = torch.zeros(1, device='cuda'), torch.randn(4096, 4096, device='cuda')
    clock = timing.DeviceClock(torch.device('cuda', torch.cuda.current_device()))
    def read(f):
        t0 = clock(); f(); return clock() - t0
    def host_bound(s): return lambda: (a.add_(1), time.sleep(s), a.add_(1))
    def gpu_bound():
        for _ in range(10): m @ m
    # the first add of a fresh process (its kernel loaded then, lazily) read 14 ms for this 1 ms call on an H200: the
    # GPU waited behind the start event; run once before the clock reads
    host_bound(0)(); torch.cuda.synchronize()
    assert read(host_bound(0.001)) < 5e-4 and clock.overran == 0   # issued within the first sleep (10 ms)
    read(host_bound(0.02))   # issued over longer than the sleep (4x the last call's issue time): the GPU waited
    assert clock.overran == 1 and clock.sleep_s >= 0.04
    assert read(host_bound(0.02)) < 5e-4 and clock.overran == 1
    read(gpu_bound)   # cuBLAS's first call
    torch.cuda.synchronize(); t = time.perf_counter(); gpu_bound(); torch.cuda.synchronize()
    wall = time.perf_counter() - t
    assert 0.5 * wall < read(gpu_bound) < 1.1 * wall

class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None): return func(*args, **(kwargs or {}))

@contextlib.contextmanager
def _float64_default():
    torch.set_default_dtype(torch.float64)
    try: yield
    finally: torch.set_default_dtype(torch.float32)

_CALLER_STATES = {'no_grad': torch.no_grad, 'inference_mode': torch.inference_mode, 'float64_default': _float64_default,
                  'bf16_autocast': lambda: torch.autocast('cpu', dtype=torch.bfloat16),
                  'fake_tensors': FakeTensorMode, 'flop_counter': lambda: FlopCounterMode(display=False),
                  'function_mode': _PassThrough}

def _state():
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled('cpu'),
            torch._C._len_torch_dispatch_stack(), torch._C._is_torch_function_mode_enabled(), torch.get_default_dtype(),
            torch._C._functorch.peek_interpreter_stack() is not None)

@pytest.mark.parametrize('caller', list(_CALLER_STATES))
def test_a_premise_is_measured_as_a_fresh_process_would(tmp_path, monkeypatch, caller):
    """A fact about the machine is measured once, at its first question, wherever that comes from (fastai's validation
    runs under no_grad, `get_preds` may run under inference_mode, training under autocast, `torch.export` under fake
    tensors, a flop counter as a dispatch mode): its probe runs with gradients on, no inference mode, no autocast and
    none of the caller's modes, and the caller's state is as it was after"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    seen = []
    with _CALLER_STATES[caller]():
        outside = _state()
        assert timing.decide_premise('premise:test_state', lambda: seen.append(_state()) or True) is True
        assert _state() == outside
    assert seen == [(True, False, False, 0, False, torch.float32, False)]

def test_a_premise_first_asked_inside_torch_func(tmp_path, monkeypatch):
    """Per-sample gradients (`torch.func.grad` over `vmap`) of a guarded squeeze-excite conv whose premise is not
    measured yet: the probe runs outside the transforms (its `backward()` raised inside them), and the gradients are
    fp64's"""
    from torch.func import grad, vmap, functional_call
    from clfast.routes import GuardedConv2d, SLOW_POINTWISE_MAPS
    from clfast.stock import rebuilt
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    torch.manual_seed(0)
    stock = nn.Conv2d(96, 24, 1)
    m, m64 = rebuilt(copy.deepcopy(stock), GuardedConv2d), copy.deepcopy(stock).double()
    x = torch.randn(8, 96, 1, 1)
    def per_sample(model, params, x):
        loss = lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()
        return vmap(grad(loss), in_dims=(None, 0))(params, x)
    got = per_sample(m, dict(m.named_parameters()), x)
    assert timing.timings().get(f'premise:{SLOW_POINTWISE_MAPS.name}') is not None   # measured, at this first question
    want = per_sample(m64, dict(m64.named_parameters()), x.double())
    for k in want: assert ((got[k].double() - want[k]).norm() / want[k].norm()).item() < 1e-6, k
