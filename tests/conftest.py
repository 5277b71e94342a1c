import os, pytest, torch

def pytest_collection_modifyitems(config, items):
    "Skip `cuda`-marked tests on machines without a CUDA GPU"
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if 'cuda' in item.keywords: item.add_marker(skip)

@pytest.fixture(autouse=True)
def _seed():
    "Every test starts from the same seed, so failures reproduce"
    torch.manual_seed(0)
