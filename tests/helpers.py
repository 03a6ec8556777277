"""What the tests share besides conftest.py's fixtures: one way to compare weights after optimiser steps."""

import torch

ADAMW_EPS = 1e-8  # torch.optim.AdamW's default, which the workers keep


def assert_same_adamw_steps(weights: dict, expected: dict, gradients: list[dict], lr: float, atol: float) -> None:
    """Weights after len(gradients) AdamW steps from the same start, on two ways to the same gradients.

    Each step moves a weight by lr * m / (sqrt(v) + eps), on the first step lr * g / (|g| + eps): where every |g| is far
    above eps (100 eps: within 1% of lr * sign(g)), rounding in g barely moves the step, and the weights agree to
    `atol`. Where |g| is rounding noise (the gradient of a weight that exact arithmetic leaves still, such as a key
    bias under softmax), the kernels of the CPU pick the step's size and sign: there they agree to about lr per step
    and side, Adam's largest step in its first steps. A weight with no gradient (frozen) is the same on both sides."""
    for name, value in weights.items():
        if name not in gradients[0]:
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            continue
        settled = torch.stack([step[name].abs() > 100 * ADAMW_EPS for step in gradients]).all(0)
        torch.testing.assert_close(value[settled], expected[name][settled], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(value, expected[name], rtol=0, atol=2 * lr * len(gradients), msg=lambda m: f"{name}: {m}")
