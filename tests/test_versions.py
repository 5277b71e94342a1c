"The torch range clfast admits, checked at `import clfast` from the installed torch's metadata (no torch import)"
import subprocess, sys
import pytest
from clfast.versions import torch_requirement

@pytest.mark.parametrize('version,ok', [('2.3.1', False), ('3.0.0.dev20270101+cu130', False), ('2.4.0+cpu', True),
                                        ('2.4.0a0+git1234', True), ('2.4.0rc1', True)])   # a source build, a pre-release: as their release
def test_import_names_the_admitted_torch_range(version, ok, tmp_path):
    """`import clfast` where the installed torch (its metadata: a dist-info found first on the path, as a torch
    installed after clfast would be) is outside the range clfast's metadata admits: an ImportError naming the range
    and the fix; inside it, nothing"""
    info = tmp_path/f'torch-{version.split("+")[0]}.dist-info'
    info.mkdir()
    (info/'METADATA').write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import clfast; print('imported')"
    p = subprocess.run([sys.executable, '-c', code, str(tmp_path)], capture_output=True, text=True)
    req = torch_requirement()
    assert req is not None and req.startswith('torch')   # installed: its metadata names the range
    if ok: assert p.returncode == 0 and 'imported' in p.stdout, p.stderr
    else: assert p.returncode != 0 and f"runs on {req}, this is torch {version}: install a torch in that range" in p.stderr, p.stderr

def test_help_imports_no_torch():
    "The check imports no torch: `import clfast` alone leaves torch unimported (the CLI's --help relies on it)"
    p = subprocess.run([sys.executable, '-c', "import sys, clfast; print('torch' in sys.modules)"], capture_output=True, text=True)
    assert p.stdout.strip() == 'False', p.stderr
