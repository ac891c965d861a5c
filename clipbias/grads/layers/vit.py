"""Hugging Face ViT's embeddings on the fast path: the class token and the position embeddings.

``ViTEmbeddings`` holds two bare parameters, not inside a Linear or Conv: ``cls_token`` ``[1, 1, d]`` and
``position_embeddings`` ``[1, P, d]`` (P = patches + 1). Its forward (transformers 5.x, ``_reviewed_forward``
below) computes ``t = cat((cls_token.expand(b, -1, -1), patches), 1) + position_embeddings`` and returns
``dropout(t)``. With ``G = dL/dt`` (``[b, P, d]``; row i is example i's, since nothing before ``t`` mixes
examples and the summed loss's gradient at row i is example i's), example i's gradients are ``G_i[0]``
(the class token) and ``G_i`` (the position embeddings): formed per-example gradients, so their squared
norms are ``sq_norms``' upper bounds on what the sums release, whatever the rounding, as for the norm
layers (docs/privacy.md, "Floating point in the fast path"), and the clipped sums are ``S @ G[:, 0]`` and
``S @ G``. ``t`` is the dropout submodule's input (a forward pre-hook takes it), so the rule is exact with
dropout active: the mask is applied after ``t``, and autograd's ``G`` already holds it.

Accepted when the class is transformers' ``ViTEmbeddings`` (the class its module defines, not a subclass;
transformers is not imported here), its ``forward`` is ``_reviewed_forward`` (bytecode, constants, names,
arguments and defaults: ``rms.same_code``) and not replaced on the instance, and no trainable parameter of
its own besides those two (a trainable ``mask_token`` is refused). At every step: the forward called with
``interpolate_pos_encoding`` or ``bool_masked_pos`` (the interpolated position embeddings, the mask token)
is refused, as is a forward pre-hook on the dropout (or a global one: it could change ``t`` after the add);
and the autograd graph at ``t`` must be the reviewed one, exactly: ``t``'s node an addition (alpha 1) of
the concatenation along dimension 1 and the position embeddings' leaf, the concatenation's first input
the class token expanded from ``[1, 1, d]`` (``check_graph``). The engine's ``_check_graph`` then checks
that each parameter enters the graph once, there. A refusal is a ``PathRefusal``: under
``grad_path="auto"`` the step runs on the rows path."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...errors import PathRefusal
from .. import rms
from ..formed import FormedRows
from .base import Rule, register

REVIEWED = frozenset({("transformers.models.vit.modeling_vit", "ViTEmbeddings")})
"""transformers' ViT embeddings class whose ``forward`` was reviewed (transformers 5.x): (module, class name)."""

PARAMS = ("cls_token", "position_embeddings")
"""The parameters the rule computes, in the order its sums return them."""


def _reviewed_forward(
    self,
    pixel_values: torch.Tensor,
    bool_masked_pos: torch.BoolTensor | None = None,
    interpolate_pos_encoding: bool = False,
) -> torch.Tensor:
    batch_size, num_channels, height, width = pixel_values.shape
    embeddings = self.patch_embeddings(pixel_values)

    if bool_masked_pos is not None:
        seq_length = embeddings.shape[1]
        mask_tokens = self.mask_token.expand(batch_size, seq_length, -1)
        # replace the masked visual tokens by mask_tokens
        mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)
        embeddings = embeddings * (1.0 - mask) + mask_tokens * mask

    # add the [CLS] token to the embedded patch tokens
    cls_tokens = self.cls_token.expand(batch_size, -1, -1)
    embeddings = torch.cat((cls_tokens, embeddings), dim=1)

    if interpolate_pos_encoding:
        embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width)
    else:
        if height != self.image_size[0] or width != self.image_size[1]:
            raise ValueError(
                f"Input image size ({height}*{width}) doesn't match model"
                f" ({self.image_size[0]}*{self.image_size[1]})."
            )
        embeddings = embeddings + self.position_embeddings

    embeddings = self.dropout(embeddings)

    return embeddings


def hf_class(m: nn.Module) -> bool:
    """``m``'s class is one of ``REVIEWED`` (the class its module defines), whatever its forward."""
    return rms.reviewed_class(m, REVIEWED)


def trainable(m: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters the rule computes, in ``PARAMS`` order."""
    return [p for p in (getattr(m, n, None) for n in PARAMS) if isinstance(p, Tensor) and p.requires_grad]


def why_not(m: nn.Module) -> str | None:
    """None when ``m`` is the reviewed ``ViTEmbeddings`` with its reviewed forward, parameters of the
    expected shapes and no other trainable parameter of its own; else why not."""
    name = type(m).__name__
    if not hf_class(m):
        return f"{name} is not the reviewed ViTEmbeddings class"
    if "forward" in m.__dict__ or not rms.same_code(type(m).forward, _reviewed_forward):
        return (f"{name}.forward is not the reviewed ViTEmbeddings forward (transformers 5.x; replaced, edited or "
                f"another version)")
    own = sorted(n for n, p in m.named_parameters(recurse=False) if p.requires_grad and n not in PARAMS)
    if own:  # mask_token: used only with bool_masked_pos, which the step refuses; no rule for it
        return f"{name} has trainable parameters {own} besides {list(PARAMS)} (freeze them)"
    cls, pos = m.cls_token, m.position_embeddings
    if not (isinstance(cls, Tensor) and isinstance(pos, Tensor) and cls.dim() == 3 and pos.dim() == 3
            and cls.shape[:2] == (1, 1) and pos.shape[0] == 1 and cls.shape[2] == pos.shape[2]):
        return f"{name}'s cls_token or position_embeddings is not of shape [1, 1, d] / [1, P, d]"
    if not isinstance(getattr(m, "dropout", None), nn.Module) or not isinstance(getattr(m, "patch_embeddings", None),
                                                                               nn.Module):
        return f"{name}'s dropout or patch_embeddings is not a module"
    return None


def _is(node, name: str) -> bool:
    return node is not None and type(node).__name__ == name


def _leaf(node) -> Tensor | None:
    return getattr(node, "variable", None)


def check_graph(m: nn.Module, t: Tensor) -> str | None:
    """None when ``t`` (the dropout's input) is ``cat((cls_token.expand(b, -1, -1), x), 1) + position_embeddings``
    as far as the trainable parameters' edges go: the autograd nodes the reviewed forward builds; else why not."""
    cls, pos = (p if isinstance(p, Tensor) and p.requires_grad else None for p in (m.cls_token, m.position_embeddings))
    if t.dim() != 3 or t.shape[1:] != m.position_embeddings.shape[1:]:
        return f"its dropout's input has shape {list(t.shape)}, not [b, {m.position_embeddings.shape[1]}, d]"
    add = t.grad_fn
    if not _is(add, "AddBackward0") or getattr(add, "_saved_alpha", None) != 1 or len(add.next_functions) != 2:
        return "its dropout's input is not the sum of the embeddings and the position embeddings"
    (cat, _), (p_node, _) = add.next_functions
    if pos is not None and _leaf(p_node) is not pos:
        return "the position embeddings do not enter the sum before its dropout as themselves"
    if cls is not None:
        ok = _is(cat, "CatBackward0") and getattr(cat, "_saved_dim", None) == 1 and len(cat.next_functions) == 2
        expand = cat.next_functions[0][0] if ok else None
        if not (_is(expand, "ExpandBackward0") and tuple(getattr(expand, "_saved_self_sym_sizes", ())) ==
                tuple(cls.shape) and len(expand.next_functions) == 1 and _leaf(expand.next_functions[0][0]) is cls
                and _expanded_positions(expand) in (1, None)):
            return "the class token does not enter the embeddings as their first position, expanded to the batch"
    return None


def _expanded_positions(expand) -> int | None:
    """The positions the class token was expanded to (1 in the reviewed forward), from the node's output
    metadata (private torch API: None where this torch has none; the reviewed bytecode says 1)."""
    meta = getattr(expand, "_input_metadata", None)
    try:
        return int(meta[0].shape[1])
    except Exception:  # no metadata of that form in this torch
        return None


def hooks(m: nn.Module, record) -> list:
    """The step's hooks on a ViTEmbeddings layer ``m``: its call refused with ``interpolate_pos_encoding`` or
    ``bool_masked_pos``; its patch embeddings' output kept; at its dropout's input ``t``, the graph checked
    (``check_graph``) and ``record(m, (patch output,), t)`` called, as the fast path's forward hooks call it
    with a layer's input and output. Refuses a forward pre-hook on the dropout, or a global one."""
    if m.dropout._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks:
        raise PathRefusal("fast", "`grad_path='fast'`: a forward pre-hook is registered on a ViTEmbeddings layer's "
                          "dropout (or globally): it may change the embeddings after the position embeddings are "
                          "added. Remove it, or use `grad_path='rows'`")
    seen: dict[str, Tensor] = {}

    def call(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        masked = kwargs.get("bool_masked_pos", args[1] if len(args) > 1 else None)
        interpolate = kwargs.get("interpolate_pos_encoding", args[2] if len(args) > 2 else False)
        if masked is not None or interpolate:
            raise PathRefusal("fast", "`grad_path='fast'`: a ViTEmbeddings layer is called with "
                              "`interpolate_pos_encoding=True` or `bool_masked_pos` (interpolated position embeddings, "
                              "a mask token), which its fast-path rule does not cover. Use `grad_path='rows'`")

    def patches(mod: nn.Module, inp: tuple, out: Tensor) -> None:
        seen["patches"] = out

    def before_dropout(mod: nn.Module, inp: tuple) -> None:
        t = inp[0]
        why = check_graph(m, t) if isinstance(t, Tensor) else "its dropout's input is not a tensor"
        if why is not None:
            raise PathRefusal("fast", f"`grad_path='fast'`: a ViTEmbeddings layer: {why}, as its reviewed forward "
                              f"computes them. Use `grad_path='rows'`")
        record(m, (seen.pop("patches", t),), t)

    return [m.register_forward_pre_hook(call, with_kwargs=True), m.patch_embeddings.register_forward_hook(patches),
            m.dropout.register_forward_pre_hook(before_dropout)]


class Tokens(FormedRows):
    """The rule: from ``g = dL/dt`` (``[b, P, d]``), example i's class-token gradient ``g_i[0]`` and
    position-embedding gradient ``g_i``, formed (module doc)."""

    def __init__(self, m: nn.Module, g: Tensor) -> None:
        b = g.shape[0]
        cls, pos = (isinstance(p, Tensor) and p.requires_grad for p in (m.cls_token, m.position_embeddings))
        self.form(([g[:, 0]] if cls else []) + ([g.reshape(b, -1)] if pos else []))


class ViTEmbeddingsRule(Rule):
    """``ViTEmbeddings`` exactly (``hf_class``), its forward, parameters and graph checked (module doc)."""

    name = "vit-embeddings"

    def kind(self, c: type) -> bool:
        return (c.__module__, c.__qualname__) in REVIEWED

    def claims(self, m: nn.Module) -> bool:
        return hf_class(m)

    def why_not(self, m: nn.Module, name: str) -> str | None:  # its own parameters, shapes and forward
        why = why_not(m)
        return None if why is None else f"module '{name}': {why}"

    def params(self, m: nn.Module) -> list[nn.Parameter]:
        return trainable(m)

    def hooks(self, m: nn.Module, record) -> list:  # the output gradient taken at its dropout's input
        return hooks(m, record)

    def grads(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> Tokens:
        return Tokens(m, g)


register(ViTEmbeddingsRule())
