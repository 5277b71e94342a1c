"`from clfast.all import *`: the whole public API, fastai's multi-process training made to work on the CPU (`clfast.distrib`), and `Learner` patched with `to_channelslast`, `to_contiguous`, `to_fp16`/`to_bf16`/`to_fp32`, `audit_channelslast`, `check_channelslast` and `format_find`."
# Hand-written, as fastai's own `all.py` modules: re-exports only, nothing to document in a notebook.
from .core import *
from .amp import *
from .callback import *
from .graphs import *
from .audit import *
from .fused import *
from .recompute import recomputed_outputs
from .fuse import *
from .bad_kernels import *
from .routes import *
from .guard import *
from .timing import timings, forget_timings
from .stock import stock_copy
from .check import conv_geometries, check_geometries, check_channelslast
from .finder import Setup, measure_setups, best_setup, bench_model, plot_setups
from .act import ACTS, act_of, get_act
from .ops import fused_conv_bn, register_kernels, kernels_ready, kernels_from
from .reference import ConvGeometry
from .distrib import *
from .patches import Patch, PATCHES, install, installed
