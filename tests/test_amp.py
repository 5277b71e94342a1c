import os, subprocess, sys, pytest, torch
from pathlib import Path
from fastai.callback.fp16 import AMPMode
from clfast.amp import resolve_amp, amp_mode_of, cpu_amp_speed
from clfast.timing import MARGIN

ROOT = str(Path(__file__).parent.parent)

def test_amp_mode_parsing():
    assert amp_mode_of('BF16') is AMPMode.BF16 and amp_mode_of(AMPMode.FP16) is AMPMode.FP16
    for bad in ('fp8', None, 16):
        with pytest.raises(ValueError, match="use one of 'fp16', 'bf16'"): amp_mode_of(bad)

def test_cpu_resolution_follows_measured_speed():
    speed = cpu_amp_speed()
    for mode, dtype in (('bf16', torch.bfloat16), ('fp16', torch.float16)):
        got, scaler, why = resolve_amp('cpu', mode)
        if speed[dtype] <= MARGIN: assert got == dtype and not why and scaler == (dtype == torch.float16)
        else:
            assert got in (torch.bfloat16, torch.float32) and not scaler and why.startswith(f"{mode} mixed precision: ")
            assert got == torch.float32 or (mode == 'fp16' and speed[torch.bfloat16] <= MARGIN)

def test_emulated_bf16_falls_back_to_fp32():
    "Capping oneDNN at AVX2 takes native bf16 away on any x86 CPU: clfast must then train fp32, saying why"
    code = "from clfast.amp import resolve_amp; print(resolve_amp('cpu', 'bf16'))"
    env = {**os.environ, 'ONEDNN_MAX_CPU_ISA': 'AVX2', 'PYTHONPATH': ROOT}
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith('(torch.float32, False,') and 'no native bf16' in out

def test_other_device_types_train_fp32_with_reason():
    got, scaler, why = resolve_amp('meta', 'bf16')
    assert got == torch.float32 and not scaler and 'meta' in why
