"""fastmoe's ``mask`` / ``mask_dict``: rows that skip the experts and take a fixed output instead. (Chapter 01.)

``mask`` holds one value per row (token): ``0`` runs the experts, a key of ``mask_dict`` takes
``mask_dict[key]`` (a ``(d,)`` or ``(k, d)`` tensor) in place of the experts' output for each of its ``k``
choices, weighted by the gate score like an expert output. fastmoe silently ignores one without the other and
leaves rows with an unknown value at zero; here both are errors.
"""
from __future__ import annotations

import torch


def check_mask_pair(mask, mask_dict) -> None:
    """``mask`` and ``mask_dict`` go together (both given or neither)."""
    if (mask is None) != (mask_dict is None):
        raise ValueError("mask and mask_dict go together: mask marks rows (0 = run the experts, key = take "
                         "mask_dict[key]); fastmoe silently ignores one without the other")


def check_mask_values(mask_dict, width: int, k: int, where: str = "mask_dict") -> None:
    """Every ``mask_dict`` value must fit a masked row's ``(k, width)`` outputs: a ``(width,)`` tensor (the same
    for each of the ``k`` choices) or ``(k, width)`` (anything torch broadcasts to ``(k, width)``, a number
    included). Refuses any other shape (a ``d_model + 1`` entry value failed inside torch's indexing, after the
    experts had run), naming the key, the shape and what fits."""
    for key, value in (mask_dict or {}).items():
        shape = tuple(torch.as_tensor(value).shape)
        try:
            fits = torch.broadcast_shapes(shape, (k, width)) == (k, width)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"{where}[{key!r}] has shape {shape}, which does not fit a masked row's output: "
                             f"expected ({width},) (d, the experts' output width) or ({k}, {width}) (top_k, d)")


def check_mask(mask, mask_dict, num_tokens: int):
    """``(T,)`` mask values (``None`` without a mask), checked: one per row, each 0 or a key of ``mask_dict``.
    Refuses a mask of the wrong length and a mask value missing from ``mask_dict``. (The shape of each
    ``mask_dict`` value is checked by :func:`fill_masked`, which knows the experts' output width.)"""
    if mask is None:
        return None
    mask = torch.as_tensor(mask).reshape(-1)
    if mask.numel() != num_tokens:
        raise ValueError(f"mask has {mask.numel()} entries but the input has {num_tokens} rows (tokens)")
    keys = list(mask_dict or {})
    known = {k.item() if torch.is_tensor(k) else k for k in keys}
    missing = sorted({v.item() for v in mask.unique()} - {0} - known)
    if missing:  # fastmoe leaves such rows at zero, silently
        raise ValueError(f"mask holds value(s) {missing} that mask_dict has no entry for (its keys: {keys}): "
                         "each nonzero mask value must be a key of mask_dict, whose value replaces the "
                         "experts' output for those rows; 0 marks the rows that run the experts")
    return mask


def fill_masked(y: torch.Tensor, mask: torch.Tensor, mask_dict, k: int) -> torch.Tensor:
    """``(T_kept*k, d)`` expert outputs of the rows whose ``mask`` is 0 -> ``(T*k, d)``: a masked row takes
    ``mask_dict[its mask value]`` for each of its ``k`` choices, the others zero. Refuses a ``mask_dict`` value
    that does not fit ``(k, d)`` (:func:`check_mask_values`) before writing anything."""
    check_mask_values(mask_dict, y.shape[-1], k)
    T = mask.numel()
    full = y.new_zeros(T, k, y.shape[-1])                                    # (T, k, d)
    full[mask == 0] = y.view(-1, k, y.shape[-1])
    for key, value in mask_dict.items():
        full[mask == key] = torch.as_tensor(value, dtype=y.dtype, device=y.device)
    return full.view(T * k, -1)
