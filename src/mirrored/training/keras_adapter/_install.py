"""The one call that makes mirrored and Keras work together, and its undo.

install() registers with mirrored.distribute how a Keras model is copied per replica and which of
its variables the replicas combine after a step, and replaces in Keras what replica threads need of
it: a random stream per replica (_seeds.py), global-batch BatchNormalization (_batchnorm.py), and
Keras's own fit, evaluate and predict on every replica (_keras_fit.py). It runs once per process,
where a Keras model is taken in (mr.Model, strategy.mirror) or a strategy's scope is entered with
keras imported; uninstall() puts Keras back as it was and takes the registrations back. Uses every section of the package.
"""
from __future__ import annotations

import threading
from typing import Any

import mirrored.distribute as md
from mirrored.training.keras_adapter import _batchnorm, _keras_fit, _mirroring, _seeds
from mirrored.training.keras_adapter._common import keras

_LOCK = threading.Lock()
_ABSENT = object()  # an attribute the owner inherited: uninstall deletes the replacement
_installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, what its own dict held), in the order replaced
_handles: list[Any] = []  # the registrations with mirrored.distribute


def installed() -> bool:
    """Whether install() is in effect."""
    return bool(_handles)


def install() -> None:
    """Installs the adapter (see the module docstring); a no-op when it is, or keras is not imported."""
    if _handles or keras() is None:
        return
    with _LOCK:
        if _handles:
            return
        for owner, name, replacement in [*_seeds.patches(), *_batchnorm.patches(), *_keras_fit.patches()]:
            _installed.append((owner, name, vars(owner).get(name, _ABSENT)))
            setattr(owner, name, replacement)
        _handles.extend([md.register_copier(_mirroring.copy_model),
                         md.register_state_tensors(_mirroring.state_tensors),
                         md.register_synced_tensors(_mirroring.optimizer_tensors)])


def uninstall() -> None:
    """Puts back what install() replaced in Keras and removes its registrations."""
    with _LOCK:
        while _installed:
            owner, name, original = _installed.pop()
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        while _handles:
            _handles.pop().remove()
