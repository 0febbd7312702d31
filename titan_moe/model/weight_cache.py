"""Low-precision copies of weights kept from one optimizer step to the next.

A weight changes only at the optimizer step, yet a layer computing in a lower precision than
its fp32 parameters would cast it in every forward (twice with activation checkpointing, once
per gradient-accumulation microbatch), and fp8 layers again in the backward. `WeightCacheMixin`
gives an nn.Module a cache of what it derives from some of its Parameters (bf16 copies of the
routed experts' weights, `titan_moe.model.moe.RoutedExperts`; fp8 codes, `titan_moe.float8`),
made by the module's own refresh method (post-optimizer hooks call it after every step) and
valid until those Parameters change:

* eager forwards compare the Parameters' version counters (every in-place write, the
  optimizer's included, bumps them) with those seen at the refresh and drop a stale cache;
* compiled forwards cannot see version counters, so they rely on the hook;
* `to()` / `cuda()` (new Parameter tensors) and `load_state_dict` drop the cache.

The cache lives in a plain attribute (not a buffer): it is not state, checkpoints never hold
it, and torch.compile reads it as a graph input (one recompile when it first appears, which
the trainer avoids by making the cache before the first step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class WeightCacheMixin:
    """Mix into an nn.Module (before nn.Module in the bases) and implement `_cache_sources`."""

    _weight_cache: Any = None
    _weight_cache_versions: tuple[int, ...] | None = None

    def _cache_sources(self) -> tuple[Tensor, ...]:
        """The Parameters the cache is derived from."""
        raise NotImplementedError

    def _store_weight_cache(self, value: Any) -> None:
        """Keep `value` (None: drop the cache) as derived from the sources as they are now."""
        self._weight_cache = value
        self._weight_cache_versions = None if value is None else tuple(w._version for w in self._cache_sources())

    def _valid_weight_cache(self) -> Any:
        """The cache if the sources have not changed since it was stored (eager check), else None."""
        cached = self._weight_cache
        if cached is None:
            return None
        if not torch.compiler.is_compiling() and tuple(w._version for w in self._cache_sources()) != self._weight_cache_versions:
            self._store_weight_cache(None)  # changed since the refresh: per call until the next one
            return None
        return cached

    def _apply(self, fn, recurse=True):
        self._store_weight_cache(None)  # new parameter tensors (to(), cuda(), ...)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._store_weight_cache(None)
        return super()._load_from_state_dict(*args, **kwargs)


class CachedCast(torch.autograd.Function):
    """``CachedCast.apply(weight, cached)`` stands for ``weight.to(cached.dtype)`` where
    ``cached`` is that cast made beforehand (detached): forward returns it, backward casts the
    gradient to ``weight``'s dtype, as ``.to()``'s backward does. Same values both ways."""

    @staticmethod
    def forward(ctx, weight: Tensor, cached: Tensor) -> Tensor:
        ctx.weight_dtype = weight.dtype
        return cached.view_as(cached)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.weight_dtype), None
