"""kvtier replay: replay request traces through kvtier (engine mode) or a model of it (fast mode)."""
