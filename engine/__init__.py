"""kvtier.engine."""
