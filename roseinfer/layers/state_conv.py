"""What recurrent layers (Mamba2, gated DeltaNet) share: the short causal convolution
(Mamba2's over x, B and C; gated DeltaNet's over q, k and v), each sequence's last
``kernel - 1`` inputs kept in its state row, the rows themselves (core/recurrent.py
binds them), and the choice of what runs their recurrences (``kernels``)."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers import recurrent_decode

log = logging.getLogger(__name__)


def kernels(device: torch.device, dtype: torch.dtype) -> str:
    """What runs the recurrences of a model computing in ``dtype``: "fla" (flash-linear-
    attention's Triton kernels: gated DeltaNet's delta rule, Mamba2's SSM as simple gated
    linear attention) on a GPU where fla-core imports, for 16-bit models; else "torch"
    (each layer's closed form, the reference). fla's prompt kernels multiply float32 in
    TF32 (states 1e-3 off the closed form on an H200), so a float32 model keeps float32."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "torch"
    return "fla" if _fla_imports() else "torch"


@functools.cache
def _fla_imports() -> bool:
    try:
        import fla.ops  # noqa: F401
    except ImportError:
        # 10-70x slower prompts (docs/kernels.md, "fla against the torch forms"): say so once
        log.warning("fla-core does not import: recurrent layers run in plain torch on this "
                    "GPU; pip install 'roseinfer[gpu]' (or fla-core) for their kernels")
        return False
    return True


def causal_conv(state: torch.Tensor, x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """A depthwise causal convolution of B sequences' step tokens ``x`` [B, T, C] after
    their stored inputs ``state`` [B, C, kernel - 1], which move on in place: [B, T, C],
    before the activation."""
    window = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=2)
    state.copy_(window[..., window.shape[2] - state.shape[2]:])
    out = F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias, groups=window.shape[1])
    return out.transpose(1, 2).to(x.dtype)


class RecurrentLayer(nn.Module):
    """A layer with a state per sequence: its convolution's last inputs (``conv_state``,
    [rows, conv_dim, kernel - 1]) and one float32 state named ``STATE`` (its shape a
    sequence: ``state_shape``). Subclasses set ``conv_dim`` and ``kernel``."""
    STATE = "state"

    def state_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """A sequence's state: name -> (shape, whether it is kept in float32)."""
        return {"conv_state": ((self.conv_dim, self.kernel - 1), False),
                self.STATE: (self.state_shape(), True)}

    def states(self, rows: torch.Tensor, fresh: bool | torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows' convolution inputs and state (zeros where ``fresh``: all of
        them, or a mask [B] of a decode batch's rows), for ``keep`` to write back. (A
        decode batch on a GPU steps both in their rows instead: layers/recurrent_decode.py.)"""
        conv, state = getattr(self, "conv_state", None), getattr(self, self.STATE, None)
        if conv is None:
            raise RuntimeError(f"{type(self).__name__} runs inside an engine step, after "
                               "core/recurrent.py has bound its state rows")
        found = conv[rows], state[rows]
        for t in found:
            if isinstance(fresh, torch.Tensor):
                t.masked_fill_(fresh.view(-1, *[1] * (t.dim() - 1)), 0)
            elif fresh:
                t.zero_()
        return found

    def convolved(self, x: torch.Tensor, rows: torch.Tensor, fresh: bool | torch.Tensor):
        """SiLU of the causal convolution of B sequences' step tokens x [B, T, C] after their
        stored inputs, and (conv, state): the copies ``keep`` writes back after the
        recurrence; (None, None) for a decode batch on a GPU, whose convolution inputs
        moved on in their rows and whose states step there too
        (layers/recurrent_decode.py)."""
        if isinstance(fresh, torch.Tensor) and recurrent_decode.steps_in_place(x):
            return recurrent_decode.conv_decode_in_place(
                x[:, 0], self.conv_state, self.conv1d, rows, fresh)[:, None], None, None
        conv, state = self.states(rows, fresh)
        return F.silu(causal_conv(conv, x, self.conv1d)), conv, state

    def keep(self, rows: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv_state[rows] = conv
        getattr(self, self.STATE)[rows] = state
