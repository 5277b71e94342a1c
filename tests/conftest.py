import os, pytest, torch
from hypothesis import settings, HealthCheck

# Property tests must say the same thing on every run: 'ci' (the default) is derandomized, so a failure reproduces
# and a green run means the same examples passed (more than the 40-60 each test drew before); 'dev' draws fresh, wider samples to explore
# (HYPOTHESIS_PROFILE=dev pytest ...). Every failing example found so far is pinned with @example in its test.
settings.register_profile('ci', derandomize=True, max_examples=80, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('dev', max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'ci'))

def pytest_collection_modifyitems(config, items):
    "Skip `cuda`-marked tests on machines without a CUDA GPU"
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if 'cuda' in item.keywords: item.add_marker(skip)

# Fused layers run fused in this suite, so that every test of them tests clfast's op; 'timed' (the default: the faster
# of fused and stock per layer shape) has its own tests in test_fused.py, and the subprocess tests (README, notebooks)
# run it
from clfast.fused import set_layer_way
set_layer_way('fused')

@pytest.fixture(autouse=True)
def _seed():
    "Every test starts from the same seed, so failures reproduce"
    torch.manual_seed(0)
