"""Router fusion: replace "sigmoid -> + bias -> top-k -> gather -> normalise" in an FX graph
with one ``titan_moe::router_topk`` call.

The pattern is what :func:`titan_moe.model.moe.route` computes from ``torch.sigmoid(logits)``
(``TopKRouter.forward``), in the graph's own IR::

    S = sigmoid(L)                          L [N, n] fp32
    A = S + B                               B [n] float (either operand order)
    T = topk(A, k, dim=-1)                  largest, sorted (the defaults); values unused
    I = T.indices / T[1]
    G = S.gather(-1, I)
    D = G / G.sum(-1, keepdim=True)
    W = D * c  (or c * D; absent means c = 1)

becomes ``W, I, G = router_topk(L, B, k, c)``. ``S``, ``A`` and the row sum stay only if
something else uses them (the MoE layer reads ``S`` detached for quantile balancing, so
there the sigmoid survives for that use and the fused op serves the routing).

Where it runs, and why there: on the graph *before* autograd, i.e. the Dynamo graph that
Inductor's ``pre_grad_custom_pass`` sees (or a backend sees before AOTAutograd). The
custom op's own autograd formula then defines the backward, and AOTAutograd saves only the
op's [N, k] outputs for it. After autograd it is too late: in the joint graph the backward
of topk/gather/sigmoid is already written out (a ``scatter_add`` into a [N, n] buffer,
summed with the scores' other gradient, times ``s (1 - s)`` of the saved [N, n] sigmoid),
and a post-grad forward graph must keep producing the tensors that backward was
partitioned to read. So this pass matches Torch IR (``torch.sigmoid``, ``Tensor.topk``,
``operator.truediv``, ...) and, for graphs traced to ATen (``make_fx``, ``torch.export``),
the corresponding ``aten`` overloads.

Only clear matches are rewritten: fp32 2-D logits and sigmoid output, a bias of shape
exactly [n], integer ``k``, top-k along the last dim with ``largest=True, sorted=True``,
the normalisation exactly as above, node meta (``val`` or ``example_value``) present to
check all of that, and no in-place use of any matched node, the logits or the bias, or of a
view of them (the pre-grad IR is not functional). Anything else leaves the graph unchanged. The op breaks
top-k ties by the lower expert index, where ``torch.topk`` leaves ties unspecified: on
inputs without tied biased scores the rewritten graph selects the same experts in the same
order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

import titan_moe.ops.router  # noqa: F401  (registers torch.ops.titan_moe.router_topk)

aten = torch.ops.aten

# Callables (Torch IR and ATen overloads) -> canonical op name. ``call_method`` nodes are
# named by their method name directly.
_FUNCTIONS = {
    torch.sigmoid: "sigmoid",
    torch.special.expit: "sigmoid",
    F.sigmoid: "sigmoid",
    aten.sigmoid.default: "sigmoid",
    operator.add: "add",
    torch.add: "add",
    aten.add.Tensor: "add",
    torch.topk: "topk",
    aten.topk.default: "topk",
    torch.gather: "gather",
    aten.gather.default: "gather",
    torch.sum: "sum",
    aten.sum.dim_IntList: "sum",
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    aten.div.Tensor: "div",
    operator.mul: "mul",
    torch.mul: "mul",
    aten.mul.Tensor: "mul",
    operator.getitem: "getitem",
    getattr: "getattr",
}
_METHODS = {"sigmoid", "add", "topk", "gather", "sum", "div", "true_divide", "mul"}

# Parameter names in call order (positional args bind to these; ATen's ``self`` is ``input``).
_PARAMS = {
    "sigmoid": ("input",),
    "add": ("input", "other", "alpha"),
    "topk": ("input", "k", "dim", "largest", "sorted"),
    "gather": ("input", "dim", "index", "sparse_grad"),
    "sum": ("input", "dim", "keepdim", "dtype"),
    "div": ("input", "other", "rounding_mode"),
    "mul": ("input", "other"),
    "getitem": ("input", "index"),
    "getattr": ("input", "name"),
}

_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _op_name(node) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        name = "div" if node.target == "true_divide" else node.target
        return name if name in _METHODS else None
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


def _bind(node: fx.Node, name: str) -> dict | None:
    """Arguments of ``node`` by parameter name, or None for an unexpected signature (e.g. ``out=``)."""
    params = _PARAMS[name]
    if len(node.args) > len(params):
        return None
    bound = dict(zip(params, node.args))
    for key, value in node.kwargs.items():
        key = "input" if key == "self" else key
        if key not in params or key in bound:
            return None
        bound[key] = value
    return bound


def _call(node, name: str) -> dict | None:
    """Bound arguments if ``node`` is a call of canonical op ``name``, else None."""
    return _bind(node, name) if _op_name(node) == name else None


def _val(node):
    """The fake/example value recorded on a node (Dynamo: ``example_value``; ATen graphs: ``val``)."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def _is_last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, ndim - 1)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mutates(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` may write into ``node``'s value: an ``out=`` argument, ``node`` as the
    first argument of an in-place method or function (name ending in ``_``, ``operator.iadd``,
    ``setitem``, ...), or as an argument an ATen schema marks as written."""
    if user.kwargs.get("out") is node or (isinstance(user.kwargs.get("out"), (tuple, list))
                                          and node in user.kwargs["out"]):
        return True
    if user.op == "call_method":
        name = str(user.target)
        return name.endswith("_") and not name.startswith("__") and bool(user.args) and user.args[0] is node
    if user.op != "call_function":
        return False
    name = getattr(user.target, "__name__", "")
    if user.target in _INPLACE_FUNCTIONS or (name.endswith("_") and not name.startswith("__")):
        if bool(user.args) and user.args[0] is node:
            return True
    schema = getattr(user.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    for i, arg in enumerate(schema.arguments):
        value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
        if value is node and arg.alias_info is not None and arg.alias_info.is_write:
            return True
    return False


def _aliases(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user``'s value (a tensor, or a tuple of them) may share memory with the tensor
    value of ``node``: a view of it. A user without recorded value counts as one."""
    ref = _val(node)
    if not isinstance(ref, torch.Tensor):
        return False
    value = _val(user)
    if value is None:
        return True
    values = value if isinstance(value, (tuple, list)) else (value,)
    try:
        ref_storage = StorageWeakRef(ref.untyped_storage())
        return any(isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) == ref_storage
                   for v in values)
    except Exception:  # no storage to compare: assume the worst
        return True


def _mutated(node) -> bool:
    """Whether anything writes into ``node``'s value, directly or through a view of it."""
    if not isinstance(node, fx.Node):
        return False
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if _mutates(user, current):
                return True
            if user not in seen and _aliases(user, node):
                seen.add(user)
                stack.append(user)
    return False


@dataclass
class _Match:
    logits: fx.Node
    bias: fx.Node
    sigmoid: fx.Node
    add: fx.Node
    topk: fx.Node
    indices: list[fx.Node]
    values: list[fx.Node]
    gather: fx.Node
    row_sum: fx.Node
    div: fx.Node
    weights: fx.Node  # the div, or the mul by the routed scale
    top_k: int
    routed_scale: float

    def nodes(self) -> list[fx.Node]:
        return [self.logits, self.bias, self.sigmoid, self.add, self.topk, *self.indices, *self.values,
                self.gather, self.row_sum, self.div, self.weights]


def _match_selection(topk: fx.Node):
    """(logits, bias, sigmoid, add, k) when ``topk`` ranks ``sigmoid(logits) + bias`` as the router does."""
    args = _call(topk, "topk")
    if args is None or "input" not in args:
        return None
    k = args.get("k")
    if not isinstance(k, int) or isinstance(k, bool):
        return None
    if args.get("largest", True) is not True or args.get("sorted", True) is not True:
        return None
    add = args["input"]
    add_args = _call(add, "add")
    if add_args is None or add_args.get("alpha", 1) != 1 or "other" not in add_args:
        return None
    for sig, bias in ((add_args["input"], add_args["other"]), (add_args["other"], add_args["input"])):
        sig_args = _call(sig, "sigmoid")
        if sig_args is not None and isinstance(bias, fx.Node):
            break
    else:
        return None
    logits = sig_args.get("input")
    lv, sv, bv, av = _val(logits), _val(sig), _val(bias), _val(add)
    if not all(isinstance(v, torch.Tensor) for v in (lv, sv, bv, av)):
        return None
    if lv.dtype != torch.float32 or sv.dtype != torch.float32 or lv.dim() != 2 or sv.shape != lv.shape:
        return None
    n = lv.shape[1]
    if bv.dim() != 1 or bv.shape[0] != n or not bv.dtype.is_floating_point or av.shape != lv.shape:
        return None
    if not (lv.device == bv.device) or not 0 < k <= n:
        return None
    if not _is_last_dim(args.get("dim", -1), 2):
        return None
    return logits, bias, sig, add, k


def _match_outputs(topk: fx.Node):
    """(indices nodes, values nodes) of a topk node whose values are unused, else None."""
    indices, values = [], []
    for user in topk.users:
        item = _call(user, "getitem") or _call(user, "getattr")
        if item is None or item.get("input") is not topk:
            return None
        which = item.get("index", item.get("name"))
        if which in (1, "indices"):
            indices.append(user)
        elif which in (0, "values") and not user.users:
            values.append(user)
        else:
            return None
    return (indices, values) if indices else None


def _match_normalisation(gather: fx.Node):
    """(row_sum, div, weights, routed_scale) for ``gather / gather.sum(-1, keepdim=True) [* c]``."""
    for row_sum in gather.users:
        sum_args = _call(row_sum, "sum")
        if sum_args is None or sum_args.get("input") is not gather or sum_args.get("dtype") is not None:
            continue
        if sum_args.get("keepdim", False) is not True or not _is_last_dim(sum_args.get("dim"), 2):
            continue
        for div in row_sum.users:
            div_args = _call(div, "div")
            if div_args is None or div_args.get("rounding_mode") is not None:
                continue
            if div_args.get("input") is not gather or div_args.get("other") is not row_sum:
                continue
            if len(div.users) == 1:
                (mul,) = div.users
                mul_args = _call(mul, "mul")
                if mul_args is not None and "other" in mul_args:
                    a, b = mul_args["input"], mul_args["other"]
                    scale = b if a is div else a if b is div else None
                    if _is_number(scale):
                        return row_sum, div, mul, float(scale)
            return row_sum, div, div, 1.0
    return None


def _match(topk: fx.Node) -> _Match | None:
    selection = _match_selection(topk)
    outputs = _match_outputs(topk) if selection else None
    if outputs is None:
        return None
    logits, bias, sig, add, k = selection
    indices, values = outputs
    for idx in indices:
        for gather in idx.users:
            g_args = _call(gather, "gather")
            if g_args is None or g_args.get("sparse_grad", False):
                continue
            if g_args.get("input") is not sig or g_args.get("index") is not idx:
                continue
            if not _is_last_dim(g_args.get("dim"), 2):
                continue
            norm = _match_normalisation(gather)
            if norm is None:
                continue
            m = _Match(logits, bias, sig, add, topk, indices, values, gather, *norm[:3], k, norm[3])
            if any(_mutated(node) for node in m.nodes()):
                return None
            return m
    return None


def _set_meta(new: fx.Node, like: fx.Node, value) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    for key in ("val", "example_value"):
        if key in like.meta:
            new.meta[key] = value


def _rewrite(m: _Match) -> None:
    graph = m.topk.graph
    op = torch.ops.titan_moe.router_topk.default
    logits_val, bias_val = _val(m.logits), _val(m.bias)
    # The output metadata, computed in the fake mode the node values live in.
    fake_mode = getattr(logits_val, "fake_mode", None)
    if fake_mode is None or getattr(bias_val, "fake_mode", None) is not fake_mode:
        fake_mode = FakeTensorMode()
        logits_val, bias_val = (fake_mode.from_tensor(v.detach()) for v in (logits_val, bias_val))
    with fake_mode, torch.no_grad():
        out_vals = op(logits_val, bias_val, m.top_k, m.routed_scale)

    with graph.inserting_before(m.topk):
        fused = graph.call_function(op, (m.logits, m.bias, m.top_k, m.routed_scale))
        weights, indices, scores = (graph.call_function(operator.getitem, (fused, i)) for i in range(3))
    _set_meta(fused, m.topk, out_vals)
    for node, like, value in ((weights, m.weights, out_vals[0]), (indices, m.indices[0], out_vals[1]),
                              (scores, m.gather, out_vals[2])):
        _set_meta(node, like, value)

    m.weights.replace_all_uses_with(weights)
    m.gather.replace_all_uses_with(scores)
    for idx in m.indices:
        idx.replace_all_uses_with(indices)
    # Erase what is now dead, consumers before producers; the sigmoid, the add and the row
    # sum stay if anything else still reads them.
    erased: set[fx.Node] = set()
    for node in (m.weights, m.div, m.row_sum, m.gather, *m.indices, *m.values, m.topk, m.add, m.sigmoid):
        if node not in erased and not node.users:
            graph.erase_node(node)
            erased.add(node)


def fuse_router_topk(graph: fx.Graph) -> int:
    """Rewrite every router pattern in ``graph`` (in place, this graph only, no recompile).

    Returns:
        The number of patterns replaced by ``titan_moe::router_topk``.
    """
    count = 0
    for node in list(graph.nodes):
        if node.graph is not graph or _op_name(node) != "topk":
            continue
        m = _match(node)
        if m is not None:
            _rewrite(m)
            count += 1
    return count
