import torch, pytest
from torch import nn
from hypothesis import given, settings, strategies as st
from clfast.core import *

shapes4 = st.tuples(*[st.integers(1, 5)] * 4)

@settings(deadline=None)
@given(shape=shapes4, channels_last_input=st.booleans())
def test_to_channels_last_properties(shape, channels_last_input):
    x = torch.randn(shape)
    if channels_last_input: x = x.contiguous(memory_format=torch.channels_last)
    y = to_channels_last(x)
    assert torch.equal(x, y)
    if is_ambiguous(x): assert y is x                     # never copied just to change strides
    else:
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert (y is x) == channels_last_input             # no copy when already channels-last
    assert to_channels_last(y) is y                       # idempotent
    z = to_contiguous_format(y)
    assert z.is_contiguous() and torch.equal(z, x)

def test_ambiguous_shapes():
    assert is_ambiguous(torch.randn(2, 1, 8, 8)) and is_ambiguous(torch.randn(2, 3, 1, 1))
    assert is_ambiguous(torch.randn(2, 3, 1, 1, 1)) and not is_ambiguous(torch.randn(2, 3, 2, 1))
    assert not is_ambiguous(torch.randn(3, 8, 8))          # not an image batch at all

def test_non_images_untouched():
    ints, flat, vol = torch.randint(0, 3, (2, 3, 4, 4)), torch.randn(2, 10), torch.randn(2, 3, 4, 5, 6)
    out = to_channels_last({'a': ints, 'b': (flat, vol)})
    assert out['a'] is ints and out['b'][0] is flat
    assert out['b'][1].is_contiguous(memory_format=torch.channels_last_3d)

def test_model_to_keeps_identity_and_converts_grads():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv3d(4, 2, 2))
    m[0].weight.grad = torch.randn_like(m[0].weight)
    w = m[0].weight
    model_to(m)
    assert m[0].weight is w and w.is_contiguous(memory_format=torch.channels_last)
    assert w.grad.is_contiguous(memory_format=torch.channels_last)
    assert m[1].weight.is_contiguous(memory_format=torch.channels_last_3d)
    model_to(m, channels_last=False)
    assert w.is_contiguous() and w.grad.is_contiguous() and m[1].weight.is_contiguous()

def test_opt_state_to_torch_optimizer():
    m = nn.Conv2d(3, 8, 3)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 3, 8, 8)).sum().backward(); opt.step()
    opt_state_to(opt, channels_last=True)
    st_ = opt.state[m.weight]
    assert st_['exp_avg'].is_contiguous(memory_format=torch.channels_last)
    assert st_['step'].dim() == 0                          # scalars untouched
    opt_state_to(opt, channels_last=False)
    assert st_['exp_avg'].is_contiguous() and st_['exp_avg_sq'].is_contiguous()

def test_a_warning_raised_while_importing_names_the_users_import(tmp_path, monkeypatch):
    "Library modules importing each other (importlib's frames between them) are passed over to the user's import line"
    import sys, warnings, clfast.core
    from clfast.core import ClfastWarning
    lib, user = tmp_path/'lib', tmp_path/'user'
    (lib/'clfast_test_pkg').mkdir(parents=True); user.mkdir()
    (lib/'clfast_test_pkg'/'__init__.py').write_text('')
    (lib/'clfast_test_pkg'/'inner.py').write_text('from clfast.core import warn_user\nwarn_user("said while importing")\n')
    (lib/'clfast_test_pkg'/'outer.py').write_text('import clfast_test_pkg.inner\n')
    (user/'clfast_test_user.py').write_text('"a user module"\nimport clfast_test_pkg.outer\n')
    library = clfast.core._library_dirs()
    monkeypatch.setattr(clfast.core, '_library_dirs', lambda: library + (str(lib) + '/',))   # as if it were fastai's
    for p in (lib, user): monkeypatch.syspath_prepend(str(p))
    for m in ('clfast_test_pkg', 'clfast_test_pkg.inner', 'clfast_test_pkg.outer', 'clfast_test_user'):
        monkeypatch.delitem(sys.modules, m, raising=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        import clfast_test_user
    assert [(x.category, x.filename, x.lineno) for x in w] == [(ClfastWarning, str(user/'clfast_test_user.py'), 2)]

def _model_functions():
    from clfast.fuse import fuse_conv_bn, unfuse_conv_bn, fold_conv_bn, fusion_report, is_fused
    from clfast.guard import guard_model, unguard_model
    from clfast.audit import audit
    from clfast.check import check_channelslast
    x = torch.randn(2, 3, 8, 8)
    return {'fuse_conv_bn': fuse_conv_bn, 'unfuse_conv_bn': unfuse_conv_bn, 'fold_conv_bn': fold_conv_bn,
            'fusion_report': fusion_report, 'is_fused': is_fused, 'guard_model': guard_model, 'unguard_model': unguard_model,
            'model_to': model_to, 'audit': lambda m: audit(m, x), 'check_channelslast': lambda m: check_channelslast(m, x)}

@pytest.mark.parametrize('name', list(_model_functions()))
def test_model_functions_say_what_to_pass(name):
    "A model's name or a Learner where a model goes: a TypeError saying what to pass (they failed deep inside, or a Learner's attribute delegation half-worked)"
    from helpers import tiny_learner
    f, learn = _model_functions()[name], tiny_learner()
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(TypeError, match=rf"{name} takes an nn.Module, not a name \('resnet18'\): create the model first"): f('resnet18')
    with pytest.raises(TypeError, match=rf"{name} takes an nn.Module, got a Learner: pass its model, `{name}\(learn.model, ...\)`"): f(learn)
    with pytest.raises(TypeError, match=rf"{name} takes an nn.Module, got NoneType"): f(None)
    assert all(type(m).__module__.startswith(('torch.', 'fastai.')) for m in learn.model.modules())   # nothing swapped in
    assert all(torch.equal(v, before[k]) for k, v in learn.model.state_dict().items())
