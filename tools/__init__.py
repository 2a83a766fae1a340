"""kvtier.tools."""
