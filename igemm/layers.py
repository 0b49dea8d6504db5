"""Layer sets shared by the demo, the benchmarks and the algorithm comparison."""

__all__ = ["RESNET50", "RESNET50_MORE"]

#: ResNet-50's distinct conv shapes: (name, C, K, H (= W), R (= S), stride, padding).
RESNET50 = [
    ("conv1 7x7/2 3->64 @224", 3, 64, 224, 7, 2, 3),
    ("3x3 64->64 @56", 64, 64, 56, 3, 1, 1),
    ("1x1 64->256 @56", 64, 256, 56, 1, 1, 0),
    ("3x3 128->128 @28", 128, 128, 28, 3, 1, 1),
    ("3x3 256->256 @14", 256, 256, 14, 3, 1, 1),
    ("3x3 512->512 @7", 512, 512, 7, 3, 1, 1),
    ("1x1/2 512->1024 @28", 512, 1024, 28, 1, 2, 0),
]

#: ResNet-50's other distinct shapes the backward benchmark adds (same fields): a strided 3x3 and 1x1, and the
#: 1x1 reductions (K < C)
RESNET50_MORE = [
    ("3x3/2 128->128 @56", 128, 128, 56, 3, 2, 1),
    ("1x1 256->64 @56", 256, 64, 56, 1, 1, 0),
    ("1x1 1024->256 @14", 1024, 256, 14, 1, 1, 0),
    ("1x1/2 256->512 @56", 256, 512, 56, 1, 2, 0),
]
