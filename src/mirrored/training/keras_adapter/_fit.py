"""Keras's own model.fit on a model compiled in a strategy's scope: until it distributes, it warns
once, at the user's line, that it trains on one device. patches() lists what install() replaces in
keras.Model. Uses mirrored.distribute and keras."""
from __future__ import annotations

import warnings
from typing import Any

import mirrored.distribute as md


def patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for keras.Model.compile (marks a model compiled in a scope of
    several replicas) and keras.Model.fit (warns for such a model, or inside such a scope)."""
    import keras

    cls = keras.Model
    compile_, fit = cls.compile, cls.fit

    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        if md.has_strategy() and md.get_strategy().num_replicas_in_sync > 1:
            self.__dict__["_mirrored_scope"] = md.get_strategy()
        return compile_(self, *args, **kwargs)

    def fitting(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = self.__dict__.get("_mirrored_scope") or (md.get_strategy() if md.has_strategy() else None)
        if strategy is not None and not self.__dict__.get("_mirrored_warned"):
            self.__dict__["_mirrored_warned"] = True
            warnings.warn(f"{type(self).__name__}.fit (Keras's own) trains on one device: Keras does not know "
                          f"mirrored's {type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas. "
                          "Wrap the model: model = mr.Model(keras_model) in strategy.scope(), then "
                          "model.compile(...) and model.fit(...).", UserWarning, stacklevel=2)
        return fit(self, *args, **kwargs)

    compile.__wrapped__ = compile_  # type: ignore[attr-defined]
    fitting.__wrapped__ = fit  # type: ignore[attr-defined]
    return [(cls, "compile", compile), (cls, "fit", fitting)]
