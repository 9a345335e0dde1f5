"""The one table of gradient-exchange strategies, and how a name becomes one.

``rt.allreduce(t, algorithm=...)``, ``rt.DistributedOptimizer(strategy=...)``, the Keras
and Horovod front ends all resolve names here. A strategy class declares its ``name``
and its ``options``; this table is the only list of them.
"""

from __future__ import annotations

from typing import Any

from ringtrain.collectives import AllreduceAlgorithm
from ringtrain.errors import ConfigError
from ringtrain.sync.base import Strategy
from ringtrain.sync.native import Native
from ringtrain.sync.ps import ParameterServer
from ringtrain.sync.ring import Ring

__all__ = ["STRATEGIES", "make_strategy", "resolve"]

#: name -> strategy class (``strategy=`` / ``algorithm=``).
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Native, Ring, ParameterServer)}

# Strategies built from a bare name (no options) are stateless between calls, so one
# instance per name serves every rt.allreduce(algorithm=name) call.
_DEFAULTS: dict[str, Strategy] = {}


def _choices() -> str:
    return ", ".join(STRATEGIES)


def make_strategy(strategy: str | AllreduceAlgorithm, **options: Any) -> AllreduceAlgorithm:
    """``"native"`` / ``"ring"`` / ``"ps"`` plus options -> a strategy object.

    Options are those the strategy class declares (``stall_timeout`` everywhere,
    ``ps_servers`` for ps, ``chunks_per_rank`` for ring and ps). A callable (a strategy
    object or any allreduce algorithm) is returned unchanged; options are then an error.
    """
    if not isinstance(strategy, str):
        if not callable(strategy):
            raise ConfigError(f"strategy must be one of {_choices()} or an allreduce object, "
                              f"got {strategy!r}")
        if options:
            raise ConfigError(
                f"options {sorted(options)} only apply to a strategy given by name "
                f"({_choices()}); configure the object itself instead"
            )
        return strategy
    cls = STRATEGIES.get(strategy)
    if cls is None:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of: {_choices()}")
    known = {opt for c in STRATEGIES.values() for opt in c.options}
    unknown = sorted(set(options) - known)
    if unknown:
        listing = "; ".join(
            f"{opt} ({', '.join(n for n, c in STRATEGIES.items() if opt in c.options)})"
            for opt in sorted(known))
        raise ConfigError(f"unknown argument(s) {unknown}; the strategy options are: {listing}")
    misplaced = sorted(set(options) - set(cls.options))
    if misplaced:
        owners = [n for n, c in STRATEGIES.items() if set(misplaced) <= set(c.options)]
        raise ConfigError(
            f"option(s) {misplaced} apply to strategy {' / '.join(map(repr, owners))}, not to "
            f"strategy={strategy!r}; pass strategy= accordingly or drop the option"
        )
    return cls(**{cls.options[k]: v for k, v in options.items()})


def resolve(algorithm: str | AllreduceAlgorithm) -> AllreduceAlgorithm:
    """The algorithm ``rt.allreduce(..., algorithm=...)`` runs (hooked into the
    collectives by ``rt.init()``)."""
    if not isinstance(algorithm, str):
        return make_strategy(algorithm)
    if algorithm not in _DEFAULTS:
        built = make_strategy(algorithm)
        assert isinstance(built, Strategy)
        _DEFAULTS[algorithm] = built
    return _DEFAULTS[algorithm]
