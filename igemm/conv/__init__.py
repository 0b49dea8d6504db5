"""The conv family: 2-D convolution forward by implicit GEMM with fused epilogues.

``Conv2dPlan`` (a compiled problem) and the function forms ``conv2d`` / ``conv2d_bn_relu``; ``Conv2dOptions``
(paths and kernel overrides); ``KernelSpec`` and ``choose_config`` (the kernel choice, a pure function of the
problem, :data:`RULES`); ``FFMA_CONFIG`` (strict fp32 on IEEE FFMA). See docs/design.md for how a call flows.
"""
from ._backward_functional import (conv2d_backward, conv2d_bn_backward, conv2d_grad_input, conv2d_grad_prologue,
                                   conv2d_grad_weight)
from ._backward_plan import Conv2dGradInputPlan, Conv2dGradWeightPlan, GradPrologue
from ._functional import conv2d, conv2d_bn_relu
from ._options import Conv2dOptions
from ._plan import Conv2dPlan
from ._problem import ConvProblem
from ._rules import FFMA_CONFIG, RULES, candidates, choose_config
from ._spec import KernelSpec

__all__ = ["Conv2dPlan", "Conv2dOptions", "conv2d", "conv2d_bn_relu", "Conv2dGradInputPlan", "Conv2dGradWeightPlan",
           "GradPrologue", "conv2d_backward", "conv2d_grad_input", "conv2d_grad_weight", "conv2d_grad_prologue",
           "conv2d_bn_backward", "ConvProblem", "KernelSpec", "choose_config", "candidates", "RULES", "FFMA_CONFIG"]
