__version__ = "0.1.0"

# the installed torch against the range clfast admits (clfast.versions, which imports no torch): outside it, an
# ImportError naming the range, now rather than a failure somewhere inside
from .versions import check_torch as _check_torch
_check_torch()
