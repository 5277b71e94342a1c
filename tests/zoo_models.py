"The model zoo of the surgery coverage test and benchmark: timm and torchvision BN CNNs, small inputs, no weights"
import timm, torchvision
from torchvision import models as tvm

def _timm(name, **kw): return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw)
def _tv(fn, **kw): return lambda: fn(weights=None, num_classes=10, **kw)

# name -> (constructor, input size). Families: EfficientNet b0/lite0/v2 (+TF 'same' padding), MobileNetV2/V3 (timm and
# torchvision), MixNet (MixedConv2d), RegNetX/Y, CSPResNet/CSPDarkNet, DLA, HRNet, Inception-v3, ResNet/ResNet-D/
# ResNeXt/SE-ResNet, DenseNet, RepVGG, DPN, TResNet, FBNet, SPNASNet, GhostNet, MnasNet, ShuffleNet, ResNetV2, LeViT,
# ResNeSt, MobileViT, MobileNetV4, ...
ZOO = {
    'efficientnet_b0': (_timm('efficientnet_b0'), 64),
    'efficientnet_lite0': (_timm('efficientnet_lite0'), 64),
    'efficientnetv2_rw_t': (_timm('efficientnetv2_rw_t'), 64),
    'tf_efficientnet_b0': (_timm('tf_efficientnet_b0'), 65),      # Conv2dSame, an odd size to pad asymmetrically
    'mobilenetv2_050': (_timm('mobilenetv2_050'), 64),
    'mobilenetv3_small_050': (_timm('mobilenetv3_small_050'), 64),
    'tv_mobilenet_v2': (_tv(tvm.mobilenet_v2, width_mult=0.5), 64),
    'tv_mobilenet_v3_small': (_tv(tvm.mobilenet_v3_small), 64),
    'mixnet_s': (_timm('mixnet_s'), 64),
    'tf_mixnet_s': (_timm('tf_mixnet_s'), 64),
    'regnetx_002': (_timm('regnetx_002'), 64),
    'regnety_002': (_timm('regnety_002'), 64),
    'cspresnet50': (_timm('cspresnet50'), 64),
    'cs3darknet_s': (_timm('cs3darknet_s'), 64),
    'dla46_c': (_timm('dla46_c'), 64),
    'hrnet_w18_small': (_timm('hrnet_w18_small'), 64),
    'tv_inception_v3': (_tv(tvm.inception_v3, aux_logits=False, init_weights=False), 75),
    'resnet18': (_timm('resnet18'), 64),
    'resnet26d': (_timm('resnet26d'), 64),
    'seresnext26d_32x4d': (_timm('seresnext26d_32x4d'), 64),
    'tv_resnet18': (_tv(tvm.resnet18), 64),
    'tv_resnext50_32x4d': (_tv(tvm.resnext50_32x4d), 64),
    'densenet121': (_timm('densenet121'), 64),
    'repvgg_a0': (_timm('repvgg_a0'), 64),
    'dpn48b': (_timm('dpn48b'), 64),
    'tresnet_m': (_timm('tresnet_m'), 64),
    'fbnetc_100': (_timm('fbnetc_100'), 64),
    'spnasnet_100': (_timm('spnasnet_100'), 64),
    'ghostnet_050': (_timm('ghostnet_050'), 64),
    'mnasnet_050': (_timm('mnasnet_050'), 64),
    'tv_mnasnet0_5': (_tv(tvm.mnasnet0_5), 64),
    'tv_shufflenet_v2_x0_5': (_tv(tvm.shufflenet_v2_x0_5), 64),
    'tv_efficientnet_b0': (_tv(tvm.efficientnet_b0), 64),
    'tv_regnet_y_400mf': (_tv(tvm.regnet_y_400mf), 64),
    'lcnet_050': (_timm('lcnet_050'), 64),
    'rexnet_100': (_timm('rexnet_100'), 64),
    'gernet_s': (_timm('gernet_s'), 64),
    'ese_vovnet19b_dw': (_timm('ese_vovnet19b_dw'), 64),
    'tv_googlenet': (_tv(tvm.googlenet, aux_logits=False, init_weights=False), 64),
    # from a sweep of 63 more models (BENCHMARKS.md, session 45): pre-activation (each conv fuses with the next
    # block's norm, never its own block's), attention with BN, split attention, conv + transformer, universal inverted
    # residuals
    'resnetv2_18d': (_timm('resnetv2_18d'), 64),
    'levit_conv_128s': (_timm('levit_conv_128s', img_size=64), 64),
    'resnest14d': (_timm('resnest14d'), 64),
    'mobilevit_xxs': (_timm('mobilevit_xxs'), 64),
    'mobilenetv4_conv_small': (_timm('mobilenetv4_conv_small'), 64),
}
