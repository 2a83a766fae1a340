"""kvtier replay: request traces through kvtier's engine (engine mode) or a model of its decisions
(the fast mode), beside a plain LRU and the offline bound.

Modules: ``trace`` (readers), ``layouts`` (presets, model configs, vLLM layout files, bytes scale),
``workload`` (chunk ids, plans, budgets' basis), ``sim`` (the fast mode and the references),
``engine_mode`` (the real engine, every restored byte checked), ``report`` and ``sweep`` (figures),
``command`` (the ``kvtier replay`` options). See docs/ARCHITECTURE.md, "Replaying traces".
"""
