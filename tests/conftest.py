import contextlib, os, random, numpy as np, pytest, torch
from hypothesis import settings, HealthCheck

# Property tests must say the same thing on every run: 'ci' (the default) is derandomized, so a failure reproduces
# and a green run means the same examples passed (more than the 40-60 each test drew before); 'dev' draws fresh, wider samples to explore
# (HYPOTHESIS_PROFILE=dev pytest ...). Every failing example found so far is pinned with @example in its test.
settings.register_profile('ci', derandomize=True, max_examples=80, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('dev', max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'ci'))

class _TritonCompiles:
    """On a GPU: what Triton's compiler cost the run (the GPU script's lease pays for it), said with pytest's summary.
    A measurement beside the tests: where it cannot be set up, the tests run all the same and the summary says why.
    Under pytest-xdist (the GPU script's parallel step) each worker counts its own, and the summary says their sum"""
    def __init__(self, config):
        self.config, self.stack, self.count, self.workers, self.started = config, contextlib.ExitStack(), None, [], 0
    def pytest_sessionstart(self, session):
        try:
            from clfast.gpu_report import counting_compiles
            self.count = (self.stack.enter_context(counting_compiles())
                          or "Triton's compiles not counted: this Triton has no compilation listener")
        except Exception as e: self.count = f"Triton's compiles not counted: {type(e).__name__}: {e}"
    def pytest_sessionfinish(self, session):
        out = getattr(self.config, 'workeroutput', None)   # an xdist worker's: sent to the controller
        if out is not None and not isinstance(self.count, str):
            c = self.count
            out['triton_compiles'] = dict(compiled=dict(c.compiled), cached=dict(c.cached), seconds=c.seconds)
    @pytest.hookimpl(optionalhook=True)   # xdist's hooks: no error where xdist is not installed
    def pytest_testnodeready(self, node): self.started += 1
    @pytest.hookimpl(optionalhook=True)   # (a worker stopped, as the GPU script's time limit does, reports nothing)
    def pytest_testnodedown(self, node, error):
        got = getattr(node, 'workeroutput', {}).get('triton_compiles')
        if got is not None: self.workers.append(got)
    def pytest_terminal_summary(self, terminalreporter):
        self.stack.close()
        c = self.count
        if self.started and not isinstance(c, str):
            for w in self.workers: c.compiled.update(w['compiled']); c.cached.update(w['cached']); c.seconds += w['seconds']
            c = f"{c} (summed over the {len(self.workers)} of {self.started} processes that reported)"
        terminalreporter.write_line(str(c))

def pytest_configure(config):
    if torch.cuda.is_available(): config.pluginmanager.register(_TritonCompiles(config), 'clfast-triton-compiles')

def pytest_collection_modifyitems(config, items):
    """Where the test command (tools/test.sh) compiles the offline compile report in the background, on what the cores
    leave idle (`CLFAST_TEST_GPU_REPORT`), that report's tests last, so that it is done by then. Skip `cuda`-marked
    tests on machines without a CUDA GPU"""
    if os.environ.get('CLFAST_TEST_GPU_REPORT'):   # a stable sort: the rest keep their order
        items.sort(key=lambda item: item.path.name == 'test_gpu_report.py')
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if 'cuda' in item.keywords: item.add_marker(skip)

# The suite checks fp32 arithmetic against fp64: CUDA's default TF32 convolutions (10-bit mantissas, for clfast's conv
# as for the stock one) would be its error, not the kernels'. Both follow the user's setting outside the suite
torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

# Fused layers run the way users run them ('timed': the faster of clfast's op and the stock modules, per layer shape),
# but in the modules that test clfast's op itself: there 'timed' could run the stock way, and the test would test that.
# Those modules say so with `pytestmark = pytest.mark.usefixtures('fused_way')`
from clfast.fused import set_layer_way

@pytest.fixture
def fused_way():
    "Fused layers run clfast's op, never the stock way (for tests of the op itself)"
    before = set_layer_way('fused')
    yield
    set_layer_way(before)

@pytest.fixture
def recipe_way():
    """'memory' layers inside `recomputed_outputs()` remember their outputs wherever a recipe is taken (for tests of the
    recipes: 'timed' picks per layer by this machine's clock, and at a test's sizes the old way can win everywhere)"""
    from clfast.fused import set_recipe_way
    before = set_recipe_way('recipe')
    yield
    set_recipe_way(before)

@pytest.fixture(autouse=True)
def _seed():
    "Every test starts from the same seeds, so failures reproduce (fastai's loaders shuffle with Python's `random`)"
    torch.manual_seed(0); random.seed(0); np.random.seed(0)
