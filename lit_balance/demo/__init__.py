"""A small causal transformer language model for demos, recipes and tests."""

from lit_balance.demo.model import DemoTransformerLM

__all__ = ["DemoTransformerLM"]
